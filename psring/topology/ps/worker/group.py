"""Parameter-server topology: every collective through sharded servers.

Ranks are the workers; the S server shards are found through the store
(``psring/{job}/server/{i}``). Every tensor is split over the shards by
:func:`psring.topology.ps.plan.plan`; for each collective a worker sends each involved shard a
join frame and its pieces, and receives result pieces straight into its output
array. Shards fold in the ring's canonical order, so ``all_reduce`` over ps returns
the same bits as over the ring. Pushes to different shards go out together. Between
processes on one host, pushed pieces of folding and relaying collectives and of
parameter mode go through the worker's shared-memory pool, and results come back
through the server process's (see :meth:`ServerLinks.share_memory` and psring.transport.shmpool).

``init_group(topology="ps")`` waits (up to its timeout) for the servers registered in
the store. It starts servers itself only when asked (``servers=S``) or on the local
default, where rank 0 embedded the store and so nobody else can have started any.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ....core import wire
from ....core.arrays import byte_view, result_empty
from ....core.codec import Codec
from ....core.fold import pieces, ring_chunk_bounds
from ....errors import CollectiveTimeoutError, PeerLostError, ProtocolError, PsringError
from ....rendezvous.scheduler import GroupSettings
from ....transport.connection import SMALL_COPY, Connection
from ....transport.local import LocalConnection
from ....transport.loop import poll_until
from ...collective import Collective
from ...group import Group
from .. import frames
from ..plan import SHARED_KINDS, per_piece, plan
from . import setup
from .hostreduce import HostReduce
from .links import ServerLinks
from .params import ParameterClient, SparseTables

logger = logging.getLogger(__name__)

#: seconds a worker waits for the shards to name the missing ranks after its deadline
TIMEOUT_REPORT_GRACE = 1.0
#: the largest collective a worker polls for its answer (PSRING_SPIN_US) rather than sleeping at once, as
#: the ring's one-hop calls do: waking costs more than the wait (docs/defaults.md#parameter-server)
SPIN_MAX = 64 << 10


class PsGroup(Group):
    """Collectives through parameter-server shards."""

    topology = "ps"

    def __init__(self, links: ServerLinks, rank: int, world_size: int, members: list[int], gid: str, timeout: float):
        super().__init__(rank, world_size, timeout=timeout, gid=gid, mailbox=links.mailbox, config=links.config)
        self.links = links
        self._broken_waiters: set[asyncio.Future[None]] = set()
        self.members = members
        self._owns_resources = gid == "0"
        #: SyncSGD(elastic=True): a lost worker does not break this group; parameter steps go on
        #: with the workers in ``live_members`` (what the shards last averaged over)
        self.elastic = False
        self.joining = False  # a worker that joined a running elastic job and waits to be admitted
        self.live_members = list(members)
        self.departed_workers: dict[int, str] = {}
        #: SyncSGD(backup=b): the shards apply each piece once all but b workers pushed it
        self.backup = 0
        self.backup_dropped = 0  # steps whose result this worker's pushes were not in (it came late)
        self.backup_skipped = 0  # steps this worker skipped: completed without it while it was behind
        #: the shards fold this group's all_reduces in rank order (a host-reduce subgroup: ranks are hosts)
        self.ordered = False
        #: all_reduce across hosts, several ranks on each: reduced within the host first (ps.worker.hostreduce)
        self.host_reduce: HostReduce | None = None
        #: parameter mode and sparse tables (SyncSGD over ps), composed
        self.params = ParameterClient(self)
        self.tables = SparseTables(self, self.params)
        links.groups[gid] = self

    def watch_broken(self) -> asyncio.Future[None]:
        """A future set when a worker is lost (at once if the group is broken already); unwatch it after."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._broken is not None:
            fut.set_result(None)
        self._broken_waiters.add(fut)
        return fut

    def unwatch_broken(self, fut: asyncio.Future[None]) -> None:
        self._broken_waiters.discard(fut)

    def sibling(self, rank: int, members: list[int], gid: str) -> PsGroup:
        """A group of the same job over the same links (the live workers' subgroup of an elastic job)."""
        return PsGroup(self.links, rank, len(members), members, gid, self.timeout)

    @property
    def num_servers(self) -> int:
        return len(self.links.shards)

    @property
    def shard_weights(self) -> tuple[int, ...] | None:
        """Each shard's share of every large tensor (the job's PSRING_PS_WEIGHTS; None: equal)."""
        return self.links.weights

    def per_shard(self) -> list[tuple[int, int]]:
        return self.links.per_shard()

    def piece_for(self, nbytes: int) -> int:
        """The bytes a collective of nbytes is pushed and folded in (PSRING_PS_PIECE; smaller where
        some worker of the job reaches a shard on another host: PSRING_PS_WIRE_PIECE)."""
        return self.links.piece_for(nbytes)

    @classmethod
    async def create(cls, settings: GroupSettings, **options: Any) -> PsGroup:
        return await setup.create(cls, settings, **options)

    # ---------------------------------------------------------------- plumbing
    def local_rank(self, global_rank: Any) -> int | None:
        return self.members.index(global_rank) if global_rank in self.members else None

    def on_server_error(self, err: PsringError) -> None:
        if self._broken is None:
            self._broken = err
        for coll in list(self._active.values()):
            coll.fail(type(err)(f"{err} (while {coll.label} was pending on rank {self.rank})"))

    def send_abort(self, seq: int, err: PsringError, reason: str) -> None:
        header = frames.abort((self.gid, seq), reason, str(err), src=self.rank)
        for conn in self.links.shards:
            if conn.is_open:
                with contextlib.suppress(PsringError):
                    conn.send_frame(dict(header))

    def _deadline_passed(self, coll: Collective) -> None:
        """Ask the shards who is missing; they answer every worker with an abort naming them."""
        if coll.done.done():
            return
        message = f"{coll.label} timed out after {self.timeout:g}s on rank {self.rank}"
        header = frames.abort((self.gid, coll.seq), "timeout", message, timeout=self.timeout, src=self.rank)
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

    def make_subgroup(self, gid: str, ranks: list[int]) -> PsGroup:
        return PsGroup(
            self.links, ranks.index(self.rank), len(ranks), [self.members[r] for r in ranks], gid, self.timeout
        )

    def stats(self) -> dict[str, int]:
        out = self.links.stats()
        if self.elastic:  # results of an elastic job depend on who was there: say so
            out["elastic_workers"] = len(self.live_members)
            out["elastic_departed"] = len(self.members) - len(self.live_members)
        hr = self.host_reduce
        if hr is not None:  # all_reduce blocks reduced within this host before they were pushed
            out["host_reduce_blocks"] = hr.blocks_done
            out["host_board_bytes_posted"] = hr.board.bytes_posted
            out["host_board_bytes_read"] = hr.board.bytes_read
        if self.backup:  # the same for backup workers: how often this worker was the one left out
            out["backup_dropped"] = self.backup_dropped
            out["backup_skipped"] = self.backup_skipped
        return out

    def _layer(self) -> Any:
        return self.links

    def check_usable(self, peer: int | None = None, receiving: bool = False, seq: int | None = None) -> None:
        super().check_usable(peer, receiving, seq)
        if self.links.lost is not None and self._broken is None:
            self._broken = self.links.lost
            super().check_usable(peer, receiving, seq)

    # ------------------------------------------------------------- the engine
    def _join(self, coll: Collective, piece: int) -> dict[str, Any]:
        return frames.join(
            self.gid, coll.seq, coll.desc, self.rank, self.world_size, piece,  # the shard splits its slice alike
            **({"ordered": True} if self.ordered else {}),
            **({"weights": list(self.links.weights)} if self.links.weights else {}),  # and cuts the tensor alike
        )

    def _push(self, coll: Collective, j: int) -> dict[str, Any]:
        return frames.data_push(self.gid, coll.seq, j, coll.desc, self.rank)

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
        layout = plan(coll.kind, n, itemsize, self.num_servers, seq, self.links.weights)
        step = per_piece(itemsize, self.links.piece_for(n * itemsize))
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
            self.mailbox.post(tag, view, self.guard(coll, make_cb(dest)))
        if not expects:
            done.set_result(None)
        # pieces may go through shared memory (the shard holds them there until folded or forwarded),
        # and results come back through the server's (a receiver that pushes nothing offers its pool too)
        large = coll.kind in SHARED_KINDS and min(step, n) * itemsize >= self.links.config.ps_shm_min
        if large and self.links.share_memory_pending():
            await self.links.share_memory()
        shared = push and large
        # an all_reduce is done only when every piece pushed has come back folded: the shard in this
        # process may fold straight out of x (no copy of the pieces it owns)
        lend = coll.kind == "all_reduce"
        used = []
        owner = (gid, seq)
        for shard, a, b in layout:
            conn = self.links.shards[shard]
            join = self._join(coll, step * itemsize)
            if push and x is not None and (b - a) * itemsize <= SMALL_COPY and not shared and not conn.is_local:
                # a small slice: the join and its pieces in one write (the kernel's send is most of their cost)
                frames: list[tuple[dict[str, Any], Any]] = [(join, None)]
                for j, (pa, pb) in enumerate(pieces(a, b, step)):
                    xp = x[pa:pb]
                    head = {**self._push(coll, j), **wire.tensor_fields(xp)}
                    frames.append((head, byte_view(xp) if pb > pa else None))
                conn.send_frames(frames)
                used.append(conn)
                continue
            conn.send_frame(join)
            if push and x is not None:
                for j, (pa, pb) in enumerate(pieces(a, b, step)):
                    if lend and isinstance(conn, LocalConnection):
                        conn.lend_tensor(self._push(coll, j), x[pa:pb])
                        continue
                    if shared and conn.shm.peer_maps_pool:
                        await self.links.slot_for(owner)
                    conn.send_tensor(self._push(coll, j), x[pa:pb], shared=shared, owner=owner)
            used.append(conn)
        if not done.done() and n * itemsize <= SPIN_MAX and self.links.config.spin_us > 0 and ServerLinks.live == 1:
            # a lone worker in its process: read the answer as it lands (and, colocated, the pushes to this
            # process's shard) rather than after the kernel wakes this process
            poll_until(done, time.perf_counter() + self.links.config.spin_s)
        await done
        for conn in used:
            await conn.flush()


    def _result_tags(self, coll: Collective, n: int, itemsize: int, out: np.ndarray, src: int | None = None):
        """(tag, destination view) for every result piece of a fold, or relayed pieces from src."""
        step = per_piece(itemsize, self.links.piece_for(n * itemsize))
        tags = []
        for shard, a, b in plan(coll.kind, n, itemsize, self.num_servers, coll.seq, self.links.weights):
            for j, (pa, pb) in enumerate(pieces(a, b, step)):
                tag = (self.gid, coll.seq, "r", shard, j) + ((src,) if src is not None else ())
                tags.append((tag, out[pa:pb], pa, pb))
        return tags

    # -------------------------------------------------------------- collectives
    async def _all_reduce(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray:
        hr = self.host_reduce
        if hr is not None and x.nbytes >= hr.min_bytes and not (self.elastic or self.backup):
            try:
                return await hr.all_reduce(coll, x, op)
            except BaseException:
                # the ranks' boards and host subgroups may have parted ways: from now on every rank
                # pushes its own tensor (each rank of a failed call comes here alike)
                self.host_reduce = None
                raise
        out = result_empty(x)
        expects = [(t, d) for t, d, _, _ in self._result_tags(coll, x.size, x.itemsize, out)]
        await self._exchange(coll, x, expects, True, x.size, x.itemsize)
        return out

    async def _all_reduce_coded(self, coll: Collective, x: np.ndarray, op: str, codec: Codec, e: Any) -> np.ndarray:
        # the layout is the float32 tensor's (as the shard computes it from the call); pieces travel encoded
        q = codec.encode(x, e)
        got = np.empty_like(q)
        expects = [(t, d) for t, d, _, _ in self._result_tags(coll, x.size, x.itemsize, got)]
        await self._exchange(coll, q, expects, True, x.size, x.itemsize)
        return codec.decode(got, e)

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
                conn.send_frame(self._join(coll, self.links.config.ps_piece))  # rows: no pieces
                for r in range(self.world_size):
                    if r != me and r % shards == s:
                        conn.send_tensor(
                            frames.data_push(self.gid, coll.seq, r, coll.desc, me),
                            xs[r],
                        )
            for conn in self.links.shards:
                await conn.flush()
            return xs[me].copy(), (str(meta.dtype), meta.shape), "cpu"
        fut = self.mailbox.expect(tag)
        try:
            for conn in self.links.shards:
                conn.send_frame(self._join(coll, self.links.config.ps_piece))
            _conn, hdr, payload = await fut
        finally:
            self.mailbox.unpost(tag)
        if "dtype" not in hdr:
            raise ProtocolError(f"scatter row from the servers carries no array (rank {src} scattered)")
        y = wire.decode_tensor(hdr, payload)
        return y, (hdr["dtype"], tuple(hdr["shape"])), str(hdr.get("dev", "cpu"))

    # -------------------------------------------------------- parameter mode
    # Used by SyncSGD: the shards hold the parameters and the optimizer state.

    def on_peer_lost(self, err: PeerLostError) -> None:
        me = self.members[self.rank]
        if self.elastic and type(err.rank) is int and err.rank in self.members and err.rank != me:
            # a worker, not a shard: collectives that needed it fail, the group and its steps go on
            if err.rank not in self.departed_workers:
                self.departed_workers[err.rank] = str(err)
                logger.warning("%r: elastic: %s; the others go on", self, err)
            for coll in list(self._active.values()):
                coll.fail(PeerLostError(f"{err} (while {coll.label} was pending on rank {self.rank})", rank=err.rank))
            return
        super().on_peer_lost(err)
        for fut in list(self._broken_waiters):
            if not fut.done():
                fut.set_result(None)

    # ------------------------------------------------------------------- p2p
    def _relay_shard(self, a: int, b: int) -> Connection:
        return self.links.shards[(self.members[a] + self.members[b]) % self.num_servers]

    async def _send(self, x: np.ndarray, dst: int, n: int, device: str) -> None:
        conn = self._relay_shard(self.rank, dst)
        header = frames.p2p(self.gid, self.rank, n, device, self.members[dst])
        conn.send_tensor(header, x)
        await conn.flush()


__all__ = ["PsGroup", "ServerLinks"]
