"""A ring rank's data links for the threaded data plane (plane.dataplane): dialled to the right and
accepted from the left at set-up, with the shared-memory segments same-host neighbours agree through the
store; a link that breaks mid-call is reported as its peer's loss."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

import msgpack

from ....errors import CollectiveTimeoutError, PeerLostError, ProtocolError, StoreError
from ....settings import Settings
from ....transport.connection import Connection
from ....transport.shmpool import PeerPool, ShmPool
from ...collective import Collective
from ..constants import PLANE_GRACE
from ..smalllinks import SmallLinks
from .dataplane import DataPlane
from .job import PlaneLinkError

logger = logging.getLogger(__name__)


class Endpoint(Protocol):
    """What the data links need of the rank's endpoint (ring.net.PeerNet)."""

    rank: int
    world_size: int
    config: Settings
    #: the rendezvous store (the shared-memory offers go through it) and this job's prefix in it
    store: Any
    prefix: str
    addresses: dict[int, tuple[str, int]]
    plane: DataPlane | None
    small: SmallLinks
    closing: bool
    lost: dict[int, PeerLostError]

    async def dial(self, rank: int, timeout: float, *, data: bool | str = False) -> Connection: ...

    def peer_lost(self, peer_rank: int, err: PeerLostError) -> None: ...


class PlaneLinks:
    """A rank's two data links (to its right neighbour, from its left) and, between same-host neighbours,
    their shared-memory segments: set up once for the group (:meth:`open`), the left's accepted when it
    dials (:meth:`accept`), a broken one reported as the peer's loss (:meth:`broken`). Held by the rank's
    endpoint (ring.net.PeerNet), whose plane, store and links it uses."""

    def __init__(self, net: Endpoint) -> None:
        self.net = net
        self.rank = net.rank
        self.world_size = net.world_size

    async def open(self, timeout: float) -> None:
        """Dial the data link to the right neighbour, wait for the left's, start the threads.
        Between same-host ranks (the mesh was agreed) each link also gets the sender's shared-memory pool."""
        net, plane = self.net, self.net.plane
        assert plane is not None and plane.recv_ready is not None
        right, left = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        shm_out: ShmPool | None = None
        if net.small.unix is not None:
            try:
                shm_out = ShmPool(net.config.ring_shm_slots, net.config.ring_plane_piece)
            except OSError as exc:
                logger.info("rank %d: no shared memory for the data link to rank %d (%s)", self.rank, right, exc)
            plane.shm_out = shm_out  # closed with the plane, whatever happens next
            offer = shm_out.describe() if shm_out is not None else None
            await net.store.set(f"{net.prefix}/shm/{self.rank}", msgpack.packb(offer))
        conn = await net.dial(right, timeout, data=True)
        plane.set_send(conn.detach())
        try:
            async with asyncio.timeout(timeout):
                await plane.recv_ready.wait()
        except TimeoutError:
            raise CollectiveTimeoutError(
                f"rank {left} did not open its data link to rank {self.rank} within {timeout:g}s", missing=(left,)
            ) from None
        if net.small.unix is not None:
            shm_in = await self._map_left_segment(left, timeout)
            mapped = shm_out is not None and await self._right_mapped(right, shm_out, timeout)
            plane.use_shm(shm_out if mapped else None, shm_in)
            if shm_out is not None and plane.shm_out is None:
                shm_out.close()
        plane.start()

    async def _map_left_segment(self, left: int, timeout: float) -> PeerPool | None:
        """Map the pool the left neighbour offered for its link to this rank, and say whether."""
        store = self.net.store
        key = f"{self.net.prefix}/shm/{left}"
        await self._wait_key(key, left, timeout)
        pool = offer = None
        try:
            offer = msgpack.unpackb(await store.get(key) or b"\xc0")
            if offer is not None:
                pool = PeerPool.open(offer)
        except (OSError, ValueError, TypeError) as exc:
            logger.info("rank %d: cannot map rank %d's shared memory (%s): its link stays on TCP", self.rank, left, exc)
        token = offer["token"] if pool is not None and isinstance(offer, dict) else None
        await store.set(f"{self.net.prefix}/shm-ok/{self.rank}", msgpack.packb(token))
        return pool

    async def _right_mapped(self, right: int, pool: ShmPool, timeout: float) -> bool:
        """Whether the right neighbour mapped this very pool (its answer names the pool's token)."""
        key = f"{self.net.prefix}/shm-ok/{right}"
        await self._wait_key(key, right, timeout)
        with contextlib.suppress(Exception):  # a peer's bytes, or a store gone: not mapped
            return bool(msgpack.unpackb(await self.net.store.get(key) or b"\xc0") == pool.token)
        return False

    async def _wait_key(self, key: str, rank: int, timeout: float) -> None:
        try:
            await self.net.store.wait([key], timeout)
        except StoreError:
            raise CollectiveTimeoutError(
                f"rank {rank} did not set up its data link within {timeout:g}s", missing=(rank,)
            ) from None

    def accept(self, conn: Connection, peer_rank: int) -> None:
        """The left neighbour's data link, as it dialled: taken out of the event loop for the plane."""
        left = (self.rank - 1) % self.world_size
        plane = self.net.plane
        if plane is None or peer_rank != left:
            raise ProtocolError(
                f"rank {peer_rank} offered a data link to rank {self.rank}: only its left neighbour "
                f"(rank {left}) may, and only when every rank runs the data plane"
            )
        if plane.recv_sock is not None:
            raise ProtocolError(f"rank {self.rank} already has a data link from rank {left}")
        plane.set_recv(conn.detach())

    def broken(self, peer_rank: int, exc: PlaneLinkError, coll: Collective) -> None:
        """A data link failed mid-collective. The control plane usually reports the same loss with
        its reason (a crash, a goodbye) at once; if it has not after PLANE_GRACE, report this."""

        net = self.net

        def check() -> None:
            if net.closing or coll.done.done():
                return
            err = PeerLostError(
                f"the data link {'to' if exc.side == 'send' else 'from'} rank {peer_rank} at "
                f"{net.addresses.get(peer_rank)} broke: {exc}",
                rank=peer_rank,
            )
            if peer_rank in net.lost:  # it left cleanly earlier; this collective needed it
                coll.fail(err)
            else:
                net.peer_lost(peer_rank, err)

        # a peer that said goodbye has no more to say: fail now; else give the control plane time
        asyncio.get_running_loop().call_later(0 if peer_rank in net.lost else PLANE_GRACE, check)
