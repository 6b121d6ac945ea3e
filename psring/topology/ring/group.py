"""Ring topology: every collective over peer-to-peer links between the ranks.

``all_reduce`` is a pipelined ring reduce-scatter then all-gather: the tensor is
split into N ring chunks, each chunk into pieces of ``PSRING_RING_PIECE`` bytes
(1 MiB), and each piece is reduced and forwarded the moment it arrives. Each rank
sends 2(N-1)/N of the tensor. From ``PSRING_RING_PLANE_MIN`` (8 MiB) up this runs on the
threaded data plane (:mod:`psring.topology.ring.plane.dataplane`); below it, in a callback in the
connection's receive path, straight into the output array (no scratch buffers, no
per-piece tasks). Small tensors take a one-hop path (every rank sends its tensor
to every other and folds locally) in the same canonical order, so the bits do not
depend on the path.

A rank listens on one port (PSRING_PORT, or an ephemeral one); peers and its data links dial it
(no back-connections)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from ...core import wire
from ...core.codec import Codec
from ...core.fold import ring_chunk_bounds
from ...errors import PeerLostError, ProtocolError, PsringError
from ...rendezvous.join import assign_rank, connect_store_of, group_set_up
from ...rendezvous.scheduler import GroupSettings
from ...transport.connection import Connection
from ..collective import Collective
from ..group import Group
from ..now import NOT_NOW, Done, Now
from . import agree, frames, quorum
from .constants import BOARD_HERE, BOARD_WAKE, SCATTER
from .context import RingContext
from .net import PeerNet
from .parts import RingParts
from .paths import Path, choose_reduce
from .quorum import Quorum

logger = logging.getLogger(__name__)


class RingGroup(Group):
    """Collectives over a ring of peer links.

    The group holds the rank's endpoint (``net``: links, boards, the data plane) and one object per
    algorithm (ring.chooser); the chooser picks an all_reduce's algorithm, the same on every rank. What
    the algorithms share is here or below: the group's numbering and books (Group, ``short``: ring.shortways), the
    small-message exchange (``exchange``), the links (``_link``, ``_links``, ``_header``).
    """

    topology = "ring"

    def __init__(self, net: PeerNet, rank: int, world_size: int, members: list[int], gid: str, timeout: float):
        super().__init__(rank, world_size, timeout=timeout, gid=gid, mailbox=net.mailbox, config=net.config)
        self.net = net
        self.members = members
        self._owns_resources = gid == "0"
        self._quorum: Quorum | None = None
        #: a new worker of a running elastic ring, until SyncSGD took its state; and what admitted it said
        self.joining = False
        self.joined_with: dict[str, Any] | None = None
        #: what the group's parts see of it (ring.context), and the parts (ring.parts: the algorithms, the
        #: chooser over them, the exchange, the short ways' helpers)
        self.ctx = RingContext(
            net,
            rank,
            world_size,
            members,
            gid,
            runtime=self,
            timeout=timeout,
            mailbox=net.mailbox,
            all_reduce_by=self.all_reduce_by,
        )
        self.peer_order = self.ctx.peer_order
        parts = RingParts(self.ctx)
        self.short, self.exchange, self.chooser = parts.short, parts.exchange, parts.chooser
        self.board, self.streamed, self.hier, self.tcp = parts.board, parts.streamed, parts.hier, parts.tcp
        self.direct, self.rooted, self.two_hop, self.ring = parts.direct, parts.rooted, parts.two_hop, parts.ring
        self.plane, self.coded = parts.plane, parts.coded
        self.one_hop = self.direct  # (gather_and_fold for reduce_scatter and reduce, either route)
        net.groups[gid] = self
        for peer, head, payload in net.small.orphans.pop(gid, ()):
            self.on_mesh(peer, head[1], head[2], head[3], memoryview(payload))

    @classmethod
    async def create(cls, settings: GroupSettings, **options: Any) -> RingGroup:
        join = options.pop("join", False)
        if options:
            raise TypeError(f"init_group(topology='ring') got unexpected options {sorted(options)}")
        if join:  # a new worker of a running elastic ring: admitted at a boundary, into a re-formed ring
            return await quorum.join(cls, settings)
        assert settings.world_size is not None
        world = settings.world_size
        prefix = f"psring/{settings.job}"
        async with group_set_up(settings, settings.rank) as setup:
            store = setup.store
            rank = await assign_rank(store, prefix, settings.rank, world)
            net = setup.owner = PeerNet(rank, world, settings, store, prefix)
            net.embedded_store = setup.embedded
            await net.start()
            await agree.resolve(net, settings.timeout)
            group = cls(net, rank, world, list(range(world)), "0", settings.timeout)
            if world > 1:
                await net.link((rank + 1) % world, settings.timeout)
            if net.plane is not None:
                await net.plane_links.open(settings.timeout)
            await net.small.open(settings.timeout)
            agree.freeze_paths(net)
            await store.barrier(f"{prefix}/ready", world, settings.timeout)
            logger.info("%r ready (store %s)", group, store.address)
            return group

    @classmethod
    async def reformed(cls, settings: GroupSettings, job: str, round_: int, rank: int, world: int) -> RingGroup:
        """A new ring of ``world`` ranks for an elastic job's round ``round_`` (its ranks and new workers):
        a full set-up under ``psring/<job>/e<round>`` on a port of its own, meeting through a store
        connection of its own (the job's store, never one served here)."""
        store = await connect_store_of(settings)
        config = settings.config.replace(job=f"{job}/e{round_}", port=0)
        return await cls.create(dataclasses.replace(settings, rank=rank, world_size=world, client=store, config=config))

    async def close(self) -> None:
        q = self._quorum
        if self.gid == "0" and q is not None:
            for ring in q.spawned:  # the rings later joins re-formed into (an elastic job's; each closes its own)
                await ring.close()
        await super().close()

    # ---------------------------------------------------------------- plumbing
    def send_abort(self, seq: int, err: PsringError, reason: str) -> None:
        self.net.flood(frames.abort(self.gid, seq, reason, str(err)))

    def make_subgroup(self, gid: str, ranks: list[int]) -> RingGroup:
        return RingGroup(
            self.net, ranks.index(self.rank), len(ranks), [self.members[r] for r in ranks], gid, self.timeout
        )

    def quorum(self) -> Quorum:
        """The rounds that re-form this ring's survivors after a loss (one per ring, kept by its root)."""
        root = self.net.groups.get("0", self)
        return root.keep_quorum(None)

    def keep_quorum(self, q: Quorum | None) -> Quorum:
        """This ring's quorum: ``q`` for a ring a round formed (its ids, registry, round), else the one it
        has, made on first use."""
        if q is not None:
            self._quorum = q
        elif self._quorum is None:
            self._quorum = Quorum(self)
        return self._quorum

    def on_peer_lost(self, err: PeerLostError) -> None:
        if err.rank is not None and err.rank in self.members and self.members != list(range(self.world_size)):
            local = self.members.index(err.rank)
            err = PeerLostError(f"{err} [rank {local} of subgroup {self.gid}]", rank=err.rank)
        super().on_peer_lost(err)

    # ---------------------------------------------------------------- the runtime's hooks
    def _end(self, coll: Collective, ok: bool) -> None:
        super()._end(coll, ok)
        self.exchange.ended(coll.seq)
        self.board.end(coll)

    def on_abort(self, seq: int, reason: str, message: str, missing: Any = (), lost: int | None = None) -> None:
        super().on_abort(seq, reason, message, missing, lost)
        self.exchange.ended(seq)

    def _has_its_data(self, coll: Collective) -> bool:
        return self.exchange.has_its_data(coll)

    def on_mesh(self, peer: int, seq: int, phase: int, call: tuple[Any, ...], payload: memoryview) -> None:
        """A message from a same-host link (psring.transport.unixmesh): the boards' own, or the exchange's."""
        if phase == BOARD_WAKE:
            self.board.on_wake()
        elif phase == BOARD_HERE:
            self.board.on_here(peer, seq, call)
        else:
            self.exchange.on_mesh(peer, seq, phase, call, payload)

    def on_mesh_closed(self, local_rank: int, gone: PeerLostError) -> None:
        self.exchange.on_mesh_closed(local_rank, gone)

    def stats(self) -> dict[str, int]:
        return self.net.stats()

    def _layer(self) -> Any:
        return self.net

    async def _flush_all(self, conns: list[Connection]) -> None:
        for conn in conns:
            await conn.flush()

    # ---------------------------------------------------------------- all_reduce: the chooser's
    async def all_reduce(self, x: Any, op: str = "sum", compression: str | Codec | None = None) -> Any:
        if compression is None and type(x) is np.ndarray:
            algo = self.chooser.algorithm(x, op)
            now = algo.soon(x, op, on_loop=True)
            if isinstance(now, Done):
                return now.value
            if now is not None:
                return await now.rest
            return await algo.all_reduce(x, op)
        return await super().all_reduce(x, op, compression)

    def try_now(self, x: Any, op: str = "sum", compression: Any = None, holds_caller: bool = True) -> Now:
        """all_reduce's short way for a caller off the event loop (the blocking API, the torch backend), when
        nothing of this group is in flight on the loop: the chooser's algorithm's ``soon``. ``holds_caller``:
        a call whose algorithm holds the caller's thread for the whole transfer (two hops, the data plane)
        may run there too -- a caller that has other work to overlap with the transfer (DDP's gradient
        hooks) says False."""
        if compression is not None or type(x) is not np.ndarray:
            return NOT_NOW
        algo = self.chooser.algorithm(x, op)
        if algo.holds_caller and not holds_caller:
            return NOT_NOW
        return algo.soon(x, op)

    async def _all_reduce(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray:
        algo = self.chooser.by_route[self.chooser.loop_path(x.nbytes)]
        if algo.route is not Path.PLANE and coll.input_wait is not None:
            coll.input_wait(0, x.size)  # the input is still coming off the device: the others need all of it
        return await algo.run(coll, x, op)

    async def _all_reduce_coded(self, coll: Collective, x: np.ndarray, op: str, codec: Codec, e: Any) -> np.ndarray:
        return await self.coded.all_reduce(coll, x, op, codec, e)

    def _input_order(self, count: int, nbytes: int) -> list[tuple[int, int]] | None:
        return self.plane.input_order(count, nbytes)

    async def _reduce_scatter(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray:
        a, b = ring_chunk_bounds(x.size, self.world_size)[self.rank]
        path = choose_reduce(x.nbytes, self.world_size, self.net.paths, to_all=True)
        if path is Path.RING:
            out = await self.ring.reduce(coll, x, op, mode="scatter")
        else:
            out = await self.one_hop.gather_and_fold(coll, x, op, path=path)
        return out[a:b].copy()

    async def _reduce(self, coll: Collective, x: np.ndarray, op: str, dst: int) -> np.ndarray | None:
        path = choose_reduce(x.nbytes, self.world_size, self.net.paths, to_all=False)
        if path is not Path.RING:
            return await self.one_hop.gather_and_fold(coll, x, op, dst, path=path)
        out = await self.ring.reduce(coll, x, op, mode="reduce", dst=dst)
        return out if self.rank == dst else None

    async def _scatter(
        self, coll: Collective, xs: np.ndarray | None, src: int, meta: np.ndarray | None
    ) -> tuple[np.ndarray, tuple[str, tuple[int, ...]], str]:
        me = self.rank
        if me == src:
            assert xs is not None and meta is not None
            targets = [r for r in range(self.world_size) if r != me]
            conns = await self.ctx.links(targets)
            for r, conn in zip(targets, conns, strict=True):
                conn.send_tensor(self.ctx.header(coll, SCATTER, 0), xs[r])
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

    async def _broadcast(self, coll: Collective, x: np.ndarray, src: int) -> np.ndarray:
        return await self.ring.broadcast(coll, x, src)

    async def _all_gather(self, coll: Collective, x: np.ndarray) -> np.ndarray:
        return await self.ring.all_gather(coll, x)

    async def _barrier(self, coll: Collective) -> None:
        await self.direct.barrier(coll)

    async def _gather(self, coll: Collective, x: np.ndarray, dst: int) -> np.ndarray | None:
        return await self.direct.gather(coll, x, dst)

    async def _send(self, x: np.ndarray, dst: int, n: int, device: str) -> None:
        conn = await self.ctx.link(dst)
        conn.send_tensor(frames.p2p(self.gid, self.rank, n, device), x)
        await conn.flush()


__all__ = ["RingGroup"]
