"""Ring topology: every collective over peer-to-peer links between the ranks.

``all_reduce`` is a pipelined ring reduce-scatter then all-gather: the tensor is
split into N ring chunks, each chunk into pieces of ``PSRING_RING_PIECE`` bytes
(1 MiB), and each piece is reduced and forwarded the moment it arrives. Each rank
sends 2(N-1)/N of the tensor. From ``PSRING_RING_PLANE_MIN`` (8 MiB) up this runs on the
threaded data plane (:mod:`psring.topology.ring.dataplane`); below it, in a callback in the
connection's receive path, straight into the output array (no scratch buffers, no
per-piece tasks). Small tensors take a one-hop path (every rank sends its tensor
to every other and folds locally) in the same canonical order, so the bits do not
depend on the path.

A rank listens on one port (PSRING_PORT, or an ephemeral one); peers and its data links dial it
(no back-connections)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from ...core import wire
from ...core.fold import ring_chunk_bounds
from ...errors import PeerLostError, ProtocolError, PsringError
from ...rendezvous.join import assign_rank, group_set_up
from ...rendezvous.scheduler import GroupSettings
from ...transport.connection import Connection
from ..collective import Collective
from ..group import Group
from .board import BoardPath
from .constants import SCATTER
from .fp16 import Fp16Ring
from .hier import Hierarchical
from .net import PeerNet
from .paths import Path, choose_all_reduce, choose_reduce
from .pipeline import Pipeline
from .plane import PlaneDriver
from .small import SmallPaths, _MeshSlot
from .tcpnow import TcpNow
from .twohop import TwoHop

logger = logging.getLogger(__name__)


class RingGroup(BoardPath, TcpNow, TwoHop, SmallPaths, Pipeline, Fp16Ring, PlaneDriver, Hierarchical, Group):
    """Collectives over a ring of peer links.

    This module holds what every path shares (set-up, links, subgroups) and which path a
    call takes; the paths themselves are mixed in from ``small``, ``pipeline``, ``fp16``
    and ``plane``.
    """

    topology = "ring"

    def __init__(self, net: PeerNet, rank: int, world_size: int, members: list[int], gid: str, timeout: float):
        super().__init__(rank, world_size, timeout=timeout, gid=gid, mailbox=net.mailbox, config=net.config)
        self.net = net
        self.members = members
        self._owns_resources = gid == "0"
        self._local = {g: r for r, g in enumerate(members)}
        #: receives posted on the same-host links, by (seq, phase); and messages that came first
        self._mesh_slots: dict[tuple[int, int], _MeshSlot] = {}
        self._mesh_early: dict[tuple[int, int, int], tuple[tuple[Any, ...], bytes]] = {}
        self._init_board()
        #: small all_reduces between hosts that ended on the caller's thread (tcpnow), and those the loop took over
        self.tcp_now = 0
        self.tcp_adopted = 0
        self.tcp_native = 0  #: of tcp_now, those that were one native call (TcpMesh.exchange)
        self._tcp_direct: dict[int, bool] = {}
        self._tcp_plans: dict[tuple[Any, ...], tuple[Any, ...] | bool] = {}
        self._tcp_last = None
        self._tcp_order = tuple((self.rank + k) % self.world_size for k in range(1, self.world_size))
        self._two_hop_plans = {}
        self._two_hop_last = None
        self._scratch = None
        net.groups[gid] = self
        for peer, head, payload in net._mesh_orphans.pop(gid, ()):
            self.on_mesh(peer, head[1], head[2], head[3], memoryview(payload))

    @classmethod
    async def create(cls, settings: GroupSettings, **options: Any) -> RingGroup:
        if options:
            raise TypeError(f"init_group(topology='ring') got unexpected options {sorted(options)}")
        assert settings.world_size is not None
        world = settings.world_size
        prefix = f"psring/{settings.job}"
        async with group_set_up(settings, settings.rank) as setup:
            store = setup.store
            rank = await assign_rank(store, prefix, settings.rank, world)
            net = setup.owner = PeerNet(rank, world, settings, store, prefix)
            net.embedded_store = setup.embedded
            await net.start()
            await net.resolve(settings.timeout)
            group = cls(net, rank, world, list(range(world)), "0", settings.timeout)
            if world > 1:
                await net.link((rank + 1) % world, settings.timeout)
            if net.plane is not None:
                await net.open_plane(settings.timeout)
            if net.mesh is not None:
                await net.open_mesh(settings.timeout)
            if net.tcp_mesh is not None:
                await net.open_tcp_mesh(settings.timeout)
            net.freeze_paths()
            await store.barrier(f"{prefix}/ready", world, settings.timeout)
            logger.info("%r ready (store %s)", group, store.address)
            return group

    # ---------------------------------------------------------------- plumbing
    async def _link(self, local_rank: int) -> Connection:
        conn = self.net.links.get(self.members[local_rank])
        if conn is not None and conn.is_open:
            return conn  # the common case, without a dial
        return await self.net.link(self.members[local_rank], self.timeout)

    async def _links(self, local_ranks: list[int]) -> list[Connection]:
        links, members = self.net.links, self.members
        conns = [links.get(members[r]) for r in local_ranks]
        if all(c is not None and c.is_open for c in conns):
            return conns  # type: ignore[return-value]
        return list(await asyncio.gather(*(self._link(r) for r in local_ranks)))

    def _header(self, coll: Collective, *tag: Any) -> dict[str, Any]:
        return {"kind": "data", "tag": (self.gid, coll.seq, *tag), "call": coll.desc, "src": self.rank}

    def _send_abort(self, seq: int, err: PsringError, reason: str) -> None:
        self.net.flood({"kind": "abort", "tag": (self.gid, seq), "reason": reason, "message": str(err)})

    def _make_subgroup(self, gid: str, ranks: list[int]) -> RingGroup:
        return RingGroup(
            self.net, ranks.index(self.rank), len(ranks), [self.members[r] for r in ranks], gid, self.timeout
        )

    def on_peer_lost(self, err: PeerLostError) -> None:
        if err.rank is not None and err.rank in self.members and self.members != list(range(self.world_size)):
            local = self.members.index(err.rank)
            err = PeerLostError(f"{err} [rank {local} of subgroup {self.gid}]", rank=err.rank)
        super().on_peer_lost(err)

    def stats(self) -> dict[str, int]:
        return self.net.stats()

    def _layer(self) -> Any:
        return self.net

    async def _flush_all(self, conns: list[Connection]) -> None:
        for conn in conns:
            await conn.flush()

    def _all_reduce_path(self, nbytes: int, fp16: bool = False) -> Path:
        """This call's path: ring.paths decides, from what every rank agreed (see choose_all_reduce)."""
        plane = self.net.plane
        return choose_all_reduce(
            nbytes,
            self.world_size,
            self.net.paths,
            world=self.gid == "0",
            fp16=fp16,
            plane_up=plane is not None and plane.ready,
        )

    async def _all_reduce(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray:
        path = self._all_reduce_path(x.nbytes)
        if path is Path.PLANE:  # reads its input range by range (coll.input_wait): see _input_order
            assert self.net.plane is not None
            return await self._plane_all_reduce(coll, x, op, self.net.plane)
        if coll.input_wait is not None:  # the input is still coming off the device: the others need all of it
            coll.input_wait(0, x.size)
        if path is Path.HIERARCHICAL:
            assert self.net.hosts is not None
            return await self._hier_all_reduce(coll, x, op, self.net.hosts)
        if path is Path.TWO_HOP:
            return await self._two_hop_all_reduce(coll, x.reshape(-1), op)
        if path is Path.RING:
            return await self._ring_reduce(coll, x, op, mode="all")
        return await self._gather_and_fold(coll, x, op, hosts=self._hier_hosts(), path=path)

    async def _reduce_scatter(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray:
        a, b = ring_chunk_bounds(x.size, self.world_size)[self.rank]
        path = choose_reduce(x.nbytes, self.world_size, self.net.paths, to_all=True)
        if path is Path.RING:
            out = await self._ring_reduce(coll, x, op, mode="scatter")
        else:
            out = await self._gather_and_fold(coll, x, op, path=path)
        return out[a:b].copy()

    async def _reduce(self, coll: Collective, x: np.ndarray, op: str, dst: int) -> np.ndarray | None:
        path = choose_reduce(x.nbytes, self.world_size, self.net.paths, to_all=False)
        if path is not Path.RING:
            return await self._gather_and_fold(coll, x, op, dst, path=path)
        out = await self._ring_reduce(coll, x, op, mode="reduce", dst=dst)
        return out if self.rank == dst else None

    async def _scatter(
        self, coll: Collective, xs: np.ndarray | None, src: int, meta: np.ndarray | None
    ) -> tuple[np.ndarray, tuple[str, tuple[int, ...]], str]:
        me = self.rank
        if me == src:
            assert xs is not None and meta is not None
            targets = [r for r in range(self.world_size) if r != me]
            conns = await self._links(targets)
            for r, conn in zip(targets, conns, strict=True):
                conn.send_tensor(self._header(coll, SCATTER, 0), xs[r])
            await self._flush_all(list(conns))
            return xs[me].copy(), (str(meta.dtype), meta.shape), "cpu"
        coll.waiting_on = {src}
        fut = self.mailbox.expect((self.gid, coll.seq, SCATTER, 0))
        try:
            _conn, hdr, payload = await fut
        finally:
            self.mailbox.unpost((self.gid, coll.seq, SCATTER, 0))
        if "dtype" not in hdr:
            raise ProtocolError(f"scatter frame from rank {src} carries no array")
        y = wire.decode_tensor(hdr, payload)
        return y, (hdr["dtype"], tuple(hdr["shape"])), str(hdr.get("dev", "cpu"))

    async def _send(self, x: np.ndarray, dst: int, n: int, device: str) -> None:
        conn = await self._link(dst)
        conn.send_tensor({"kind": "data", "tag": (self.gid, "p2p", self.rank, n), "dev": device}, x)
        await conn.flush()


__all__ = ["RingGroup"]
