"""The ring's one-hop paths for small tensors: every rank's tensor to every other (or to a rotating root),
over same-host Unix links when the ranks share a host, else TCP; folded in the canonical order.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ...core import wire
from ...core.arrays import DTYPES, byte_view, dtype_name, prod
from ...core.fold import Layout, canonical_fold
from ...errors import PeerLostError, ProtocolError
from ...transport.connection import Connection
from ...transport.loop import poll_until
from ..collective import Collective
from .constants import (
    BOARD_HERE,
    BOARD_WAKE,
    DIRECT,
    MESH_EARLY_MAX,
    MESH_MAX_BYTES,
    RESULT,
    ROOT_REPORT_GRACE,
    TO_ROOT,
)
from .net import PeerNet
from .paths import SMALL_BYTES, Path

if TYPE_CHECKING:
    from .host import RingHost as _Host
else:
    _Host = object

logger = logging.getLogger(__name__)


class SmallPaths(_Host):
    """Part of :class:`~psring.topology.ring.group.RingGroup`: the one-hop paths for small tensors."""

    # ---------------------------------------------------------- same-host links
    async def all_reduce(self, x: Any, op: str = "sum", compression: str | None = None) -> Any:
        if compression is None and type(x) is np.ndarray:
            # the quick way that took this kind of call before, without the layers before it (as all_reduce_now)
            if self.net.board is not None:
                quick = self._board_quick(x, op, None)  # (what _board_all_reduce tries first)
            else:
                quick = self._two_hop_fast(x, op, on_loop=True) if self._two_hop_plans else None
            if quick is not None:
                done, value = quick
                return value if done else await value
        kind = self._stream_kind(x, op, compression)
        if kind is not None:  # all ranks on one host, large: streamed through the boards
            assert self.net.board is not None
            return await self._stream_all_reduce(self.net.board, x, op, kind)
        board = self._board(x, compression)
        if board is not None:  # all ranks on one host, each with a board: through shared memory
            return await self._board_all_reduce(board, x, op)
        if self.net.tcp_mesh is not None:  # between hosts: the TCP small-message links, from the loop itself
            soon = self._tcp_soon(x, op, compression, on_loop=True)
            if soon is None:
                soon = self._two_hop_soon(x, op, compression, on_loop=True)
            if soon is not None:
                done, value = soon
                return value if done else await value
        # The latency path: a small, contiguous numpy array between ranks of one host goes
        # straight to the one-hop exchange, past the generic staging and dispatch. The same
        # checks hold (the pair (op, dtype) was validated once); the same bits come out.
        if (
            compression is None
            and self.net.small_links is not None
            and type(x) is np.ndarray
            and x.nbytes <= SMALL_BYTES
            and x.flags.c_contiguous
            and (op, x.dtype) in _VALID_OPS
            and (path := self._all_reduce_path(x.nbytes)) in (Path.DIRECT, Path.ROOTED)
        ):
            coll = self._begin("all_reduce", x, op)
            out = await self._run(
                coll, self._gather_and_fold(coll, x.reshape(-1), op, hosts=self._hier_hosts(), path=path)
            )
            return out.reshape(x.shape)
        out = await super().all_reduce(x, op, compression)
        if type(x) is np.ndarray:
            _VALID_OPS.add((op, x.dtype))  # it passed the checks: next time take the short way
        return out

    def on_mesh(self, peer: int, seq: int, phase: int, call: tuple[Any, ...], payload: memoryview) -> None:
        """A message from a same-host link (psring.transport.unixnet): into its posted receive, or kept."""
        if phase == BOARD_WAKE:
            self.on_board_wake()
            return
        if phase == BOARD_HERE:
            self.on_board_here(peer, seq, call)
            return
        src = self._local.get(peer)
        if src is None:
            return  # not a member of this group: nothing of ours
        slot = self._mesh_slots.get((seq, phase))
        if slot is not None:
            self._mesh_deliver(slot, src, call, payload)
            return
        coll = self._active.get(seq)
        if coll is None:
            if not self.on_stray(seq, call, src):
                return  # a collective this rank ended: a leftover (or a mismatch, now reported)
            # else one not begun yet (its number may be reserved already: fp16's scale agreement)
        elif call != coll.desc:  # a different call (whose messages this one will never ask for)
            if not coll.done.done():
                self._abort_everywhere(coll, self._mismatch_error(coll, src, call), "mismatch")
            return
        early = self._mesh_early
        if len(early) >= MESH_EARLY_MAX:
            early.pop(next(iter(early)))
            logger.warning(
                "%r: over %d same-host messages ahead of this rank; dropped the oldest", self, MESH_EARLY_MAX
            )
        early[(seq, phase, src)] = (call, bytes(payload))

    def _mesh_deliver(self, slot: _MeshSlot, src: int, call: tuple[Any, ...], payload: Any) -> None:
        coll = slot.coll
        if coll.done.done():
            return
        if call != coll.desc:
            self._abort_everywhere(coll, self._mismatch_error(coll, src, call), "mismatch")
            return
        expect = slot.expect
        if src not in expect:
            coll.fail(ProtocolError(f"rank {src} sent {coll.label} twice, or was not asked to"))
            return
        if slot.spans is not None:
            at, row = slot.spans[src]
        else:
            row = slot.row
            at = slot.at if slot.at >= 0 else src * row
        if len(payload) != row:
            coll.fail(ProtocolError(f"rank {src} sent {len(payload)} bytes for {coll.label}, expected {row}"))
            return
        if row:
            slot.dest[at : at + row] = payload
        expect.discard(src)
        if expect:
            coll.waiting_on.discard(src)
        else:
            coll.waiting_on.clear()  # every message is in: a peer leaving now costs nothing
            if not slot.done.done():
                slot.done.set_result(None)

    def on_mesh_closed(self, local_rank: int, gone: PeerLostError) -> None:
        """A departed peer's same-host link ended: a receive still waiting on it will not get it."""
        for slot in list(self._mesh_slots.values()):
            if local_rank in slot.expect:
                coll = slot.coll
                coll.fail(PeerLostError(f"{gone} (while {coll.label} was pending on rank {self.rank})", rank=gone.rank))

    def _has_its_data(self, coll: Collective) -> bool:
        """Whether coll's receive on the small-message links has every message in and coll has not run
        on yet: a peer that crashed right after it sent them (its control link ended in the same turn of
        the loop) must not fail it. If coll waits again, the broken group fails it there."""
        for slot in self._mesh_slots.values():
            if slot.coll is coll:
                return slot.done.done() and not slot.done.cancelled() and slot.done.exception() is None
        return False

    def _end(self, coll: Collective, ok: bool) -> None:
        super()._end(coll, ok)
        if self._mesh_early:
            self._forget_early(coll.seq)

    def on_abort(self, seq: int, reason: str, message: str, missing: Any = (), lost: int | None = None) -> None:
        super().on_abort(seq, reason, message, missing, lost)
        if self._mesh_early:
            self._forget_early(seq)

    def _check_early(self, coll: Collective) -> None:
        """Messages that came before this rank began ``coll``, for a phase it will not ask
        for, are another call's: a mismatch to name now, not a receive to wait on forever."""
        for (seq, _phase, src), (call, _payload) in list(self._mesh_early.items()):
            if seq == coll.seq and call != coll.desc and not coll.done.done():
                self._abort_everywhere(coll, self._mismatch_error(coll, src, call), "mismatch")
                return

    def _forget_early(self, seq: int) -> None:
        """Drop kept messages of collective seq, and of any collective this rank is done with."""
        done_below = self.stopped_at()
        for key in [k for k in self._mesh_early if k[0] == seq or k[0] < done_below]:
            del self._mesh_early[key]

    async def _mesh_exchange(
        self,
        coll: Collective,
        x: np.ndarray | None,
        phase: int,
        out: Any,
        senders: list[int],
        receivers: list[int],
        recv_phase: int,
        spans: dict[int, tuple[int, int]] | None = None,
    ) -> None:
        """_direct_exchange over the same-host links, or the TCP small-message links between hosts: one
        message per receiver, one per sender.

        ``out`` is None (no payloads), an array with one row per rank, or {src: array}; with ``spans``
        ({src: (byte offset, bytes)}) a flat array, each sender's payload at its span."""
        me, seq, mesh = self.rank, coll.seq, self.net.small_links
        assert mesh is not None
        slot: _MeshSlot | None = None
        if len(senders) > (me in senders):
            expect = set(senders)
            expect.discard(me)
            if out is None:
                dest, row, at = None, 0, 0
            elif isinstance(out, dict):
                (target,) = out.values()
                dest, row, at = byte_view(target), target.nbytes, 0
            else:
                dest, row, at = byte_view(out), out.nbytes // len(out), -1
            slot = _MeshSlot(coll, dest, row, at, expect, coll.done.get_loop().create_future(), spans)
            self._mesh_slots[(seq, recv_phase)] = slot
            coll.waiting_on = set(expect)
            coll.data_elsewhere = True  # a goodbye on the control link may overtake our messages
            if self._mesh_early:
                for src in list(expect):
                    item = self._mesh_early.pop((seq, recv_phase, src), None)
                    if item is not None:
                        self._mesh_deliver(slot, src, *item)
        if self._mesh_early:
            self._check_early(coll)
        if slot is not None:
            mesh.hold()  # the loop reads the TCP links only while it waits on them
        try:
            if len(receivers) > (me in receivers):
                payload = byte_view(x) if x is not None and x.nbytes else None
                msg = wire.encode_message((self.gid, seq, phase, coll.desc), payload)
                members, send = self.members, mesh.send
                for d in receivers:
                    if d != me:
                        send(members[d], msg)
            if slot is not None:
                if self._broken is not None and not slot.done.done():
                    self._check_usable()  # a peer was lost: raise, rather than wait on what may never come
                if mesh.spins and self.net.config.spin_us > 0 and PeerNet.live == 1 and not slot.done.done():
                    self._mesh_spin(slot)  # not with other ranks in this process: they could not run
                await slot.done
        finally:
            if slot is not None:
                mesh.release()
                del self._mesh_slots[(seq, recv_phase)]
        if mesh.backlog:
            await mesh.drain()

    def _mesh_spin(self, slot: _MeshSlot) -> None:
        """Poll the links slot waits on for up to PSRING_SPIN_US (the messages are usually close)."""
        mesh, members = self.net.mesh, self.members
        assert mesh is not None
        peers = [members[s] for s in slot.expect]
        end = time.perf_counter() + self.net.config.spin_s
        done = slot.done
        while not done.done() and time.perf_counter() < end:
            if not mesh.poll(peers):
                os.sched_yield()

    async def _direct_exchange(
        self,
        coll: Collective,
        x: np.ndarray | None,
        phase: int,
        out: Any,
        senders: list[int],
        receivers: list[int],
        recv_phase: int | None = None,
    ) -> None:
        """Send x to every rank in receivers; receive one frame from every rank in senders into
        out[src] (frames of ``recv_phase``, default ``phase``).

        The small-message path: one callback for every sender, the header built once, and no
        flush round when the kernel took every byte at once (the usual case for small frames).
        """
        me, gid, seq = self.rank, self.gid, coll.seq
        recv_phase = phase if recv_phase is None else recv_phase
        if self.net.small_links is not None and _call_bytes(coll.desc) <= MESH_MAX_BYTES:  # alike on every rank
            return await self._mesh_exchange(coll, x, phase, out, senders, receivers, recv_phase)
        expect = [s for s in senders if s != me]
        left = len(expect)
        done: asyncio.Future[None] | None = None
        if left:
            done = asyncio.get_running_loop().create_future()
            coll.waiting_on = set(expect)

            def arrived(conn: Connection, header: dict[str, Any], payload: Any) -> None:
                nonlocal left
                src = header["tag"][3]
                if out is not None and header["nbytes"] != out[src].nbytes:
                    coll.fail(ProtocolError(f"rank {src} sent {header['nbytes']} bytes, expected {out[src].nbytes}"))
                    return
                coll.waiting_on.discard(src)
                left -= 1
                if left == 0 and not done.done():
                    coll.waiting_on.clear()  # every frame is in: a peer leaving now costs nothing
                    done.set_result(None)

            post = self.mailbox.post
            for src in expect:
                dest = byte_view(out[src]) if out is not None and out[src].nbytes else None
                post((gid, seq, recv_phase, src), dest, arrived)
        targets = [d for d in receivers if d != me]
        conns = await self._links(targets) if targets else []
        if conns:
            header: dict[str, Any] = {"kind": "data", "tag": (gid, seq, phase, me), "call": coll.desc, "src": me}
            payload = None
            if x is not None:
                header["dtype"], header["shape"] = dtype_name(x.dtype), list(x.shape)
                payload = byte_view(x) if x.nbytes else None
            last = len(conns) - 1
            for i, conn in enumerate(conns):
                conn.send_frame(header if i == last else dict(header), payload)
        if done is not None:
            if not done.done() and self.net.config.spin_us > 0 and PeerNet.live == 1:
                poll_until(done, time.perf_counter() + self.net.config.spin_s)
            await done
        for conn in conns:
            transport = conn.transport
            if transport is None or transport.get_write_buffer_size():
                await conn.flush()

    # -------------------------------------------------------------- collectives
    async def _gather_and_fold(
        self,
        coll: Collective,
        x: np.ndarray,
        op: str,
        dst: int | None = None,
        hosts: Layout | None = None,
        path: Path = Path.DIRECT,
    ) -> Any:
        """One-hop path (``path``, chosen by ring.paths: DIRECT or, to every rank, ROOTED): every rank's x
        goes to dst (None: to every rank), folded there in canonical order (with ``hosts``, all_reduce
        across hosts: the two-level order)."""
        n_ranks, me = self.world_size, self.rank
        if dst is None and path is Path.ROOTED:
            return await self._rooted(coll, x, lambda bufs: canonical_fold(bufs, op, np.empty_like(x), hosts=hosts))
        ranks = list(range(n_ranks))
        receives = dst is None or me == dst
        bufs = np.empty((n_ranks, x.size), x.dtype) if receives else None
        if bufs is not None:
            bufs[me] = x
        if n_ranks > 1:
            await self._direct_exchange(
                coll, x, DIRECT, bufs, ranks if receives else [], ranks if dst is None else [dst]
            )
        return None if bufs is None else canonical_fold(bufs, op, np.empty_like(x), hosts=hosts)

    async def _rooted(self, coll: Collective, x: np.ndarray, fold: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Small all_reduce through one root (``seq % N``): it gathers every rank's x (rows in
        rank order), applies ``fold`` (the canonical order) and sends the result to all. The
        root sees every rank's call, so a mismatch anywhere is caught there; the others check
        the root's."""
        n_ranks, me = self.world_size, self.rank
        root = coll.seq % n_ranks
        if me == root:
            bufs = np.empty((n_ranks, x.size), x.dtype)
            bufs[me] = x
            await self._direct_exchange(coll, None, DIRECT, bufs, list(range(n_ranks)), [])
            out = fold(bufs)
            await self._direct_exchange(coll, out, RESULT, None, [], list(range(n_ranks)))
            return out
        out = np.empty_like(x)
        coll.report_grace = ROOT_REPORT_GRACE  # a silent rank is the root's to name
        await self._direct_exchange(coll, x, DIRECT, {root: out}, [root], [root], recv_phase=RESULT)
        return out

    async def _barrier(self, coll: Collective) -> None:
        n_ranks, me = self.world_size, self.rank
        ranks = list(range(n_ranks))
        if self.net.paths.one_hop(n_ranks) is Path.ROOTED:  # through a rotating root, as a small all_reduce
            root = coll.seq % n_ranks
            if me == root:
                await self._direct_exchange(coll, None, DIRECT, None, ranks, [])
                await self._direct_exchange(coll, None, RESULT, None, [], ranks)
            else:
                coll.report_grace = ROOT_REPORT_GRACE
                await self._direct_exchange(coll, None, DIRECT, None, [root], [root], recv_phase=RESULT)
        elif n_ranks > 1:
            await self._direct_exchange(coll, None, DIRECT, None, ranks, ranks)

    async def _gather(self, coll: Collective, x: np.ndarray, dst: int) -> np.ndarray | None:
        n_ranks, me = self.world_size, self.rank
        if me == dst:
            out = np.empty((n_ranks, x.size), x.dtype)
            out[me] = x
            if n_ranks > 1:
                await self._direct_exchange(coll, None, TO_ROOT, out, list(range(n_ranks)), [])
            return out
        await self._direct_exchange(coll, x, TO_ROOT, None, [], [dst])
        return None


def _call_bytes(desc: tuple[Any, ...]) -> int:
    """The size of a collective's input, from its descriptor (the same on every rank)."""
    dtype, shape = desc[1], desc[2]
    if dtype is None:
        return 0
    return prod(shape) * DTYPES[dtype].itemsize


#: (op, dtype) pairs that passed Group.all_reduce's checks (a valid op for a supported dtype)
_VALID_OPS: set[tuple[str, np.dtype]] = set()


class _MeshSlot:
    """A receive posted on the same-host links: the ranks still to hear from, and where their
    payloads go (``row`` bytes each, at ``at`` in ``dest``, or at src * row when ``at`` is -1; or at
    each sender's own span, {src: (at, bytes)})."""

    __slots__ = ("at", "coll", "dest", "done", "expect", "row", "spans")

    def __init__(
        self,
        coll: Collective,
        dest: Any,
        row: int,
        at: int,
        expect: set[int],
        done: asyncio.Future[None],
        spans: dict[int, tuple[int, int]] | None = None,
    ) -> None:
        self.coll = coll
        self.dest = dest
        self.row = row
        self.at = at
        self.expect = expect
        self.done = done
        self.spans = spans
