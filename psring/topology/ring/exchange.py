"""The ring's small-message exchange: one message from every sender to every receiver of a call, and
what arrives before its receive is posted.

Every one-hop path (ring.onehop), the pipelined ring's small phases, the coded ring's and the two-hop
call's loop side send and receive through here: over the same-host Unix links or the TCP small-message
links between hosts (ring.smalllinks, ``net.small.active``: one message per receiver, read by the loop into
the posted receive), else over the ranks' ordinary connections (the mailbox). A message for a call this rank has not
begun is kept (``early``), and a message naming another call than the one it is for is a mismatch,
named on every rank.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import numpy as np

from ...core import wire
from ...core.arrays import DTYPES, byte_view, dtype_name, prod
from ...errors import PeerLostError, ProtocolError
from ...transport.connection import Connection
from ...transport.loop import poll_until
from ..collective import Collective
from . import frames
from .constants import MESH_EARLY_MAX, MESH_MAX_BYTES
from .context import RingContext, RingPart
from .net import PeerNet

logger = logging.getLogger(__name__)


class Exchange(RingPart):
    """A ring group's small-message exchange (one per group)."""

    def __init__(self, ctx: RingContext) -> None:
        super().__init__(ctx)
        #: receives posted on the small-message links, by (seq, phase); and messages that came first
        self.slots: dict[tuple[int, int], _MeshSlot] = {}
        self.early: dict[tuple[int, int, int], tuple[tuple[Any, ...], bytes]] = {}

    def ended(self, seq: int) -> None:
        """Collective seq ended (or was aborted): what was kept for it, and for any call before, goes."""
        if self.early:
            self.forget_early(seq)

    def on_mesh(self, peer: int, seq: int, phase: int, call: tuple[Any, ...], payload: memoryview) -> None:
        """A message from a same-host link (psring.transport.unixmesh) for a one-hop or ring phase: into its
        posted receive, or kept. (The boards' own messages go to the boards: RingGroup.on_mesh.)"""
        src = self.ctx.local.get(peer)
        if src is None:
            return  # not a member of this group: nothing of ours
        slot = self.slots.get((seq, phase))
        if slot is not None:
            self.deliver(slot, src, call, payload)
            return
        coll = self.rt.active(seq)
        if coll is None:
            if not self.rt.on_stray(seq, call, src):
                return  # a collective this rank ended: a leftover (or a mismatch, now reported)
            # else one not begun yet (its number may be reserved already: a codec's scale agreement)
        elif call != coll.desc:  # a different call (whose messages this one will never ask for)
            if not coll.done.done():
                self.rt.abort_mismatch(coll, src, call)
            return
        early = self.early
        if len(early) >= MESH_EARLY_MAX:
            early.pop(next(iter(early)))
            logger.warning(
                "%r: over %d same-host messages ahead of this rank; dropped the oldest", self.ctx, MESH_EARLY_MAX
            )
        early[(seq, phase, src)] = (call, bytes(payload))

    def deliver(self, slot: _MeshSlot, src: int, call: tuple[Any, ...], payload: Any) -> None:
        coll = slot.coll
        if coll.done.done():
            return
        if call != coll.desc:
            self.rt.abort_mismatch(coll, src, call)
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
        for slot in list(self.slots.values()):
            if local_rank in slot.expect:
                coll = slot.coll
                coll.fail(PeerLostError(f"{gone} (while {coll.label} was pending on rank {self.rank})", rank=gone.rank))

    def has_its_data(self, coll: Collective) -> bool:
        """Whether coll's receive on the small-message links has every message in and coll has not run
        on yet: a peer that crashed right after it sent them (its control link ended in the same turn of
        the loop) must not fail it. If coll waits again, the broken group fails it there."""
        for slot in self.slots.values():
            if slot.coll is coll:
                return slot.done.done() and not slot.done.cancelled() and slot.done.exception() is None
        return False

    def check_early(self, coll: Collective) -> None:
        """Messages that came before this rank began ``coll``, for a phase it will not ask
        for, are another call's: a mismatch to name now, not a receive to wait on forever."""
        for (seq, _phase, src), (call, _payload) in list(self.early.items()):
            if seq == coll.seq and call != coll.desc and not coll.done.done():
                self.rt.abort_mismatch(coll, src, call)
                return

    def forget_early(self, seq: int) -> None:
        """Drop kept messages of collective seq, and of any collective this rank is done with."""
        done_below = self.rt.stopped_at()
        for key in [k for k in self.early if k[0] == seq or k[0] < done_below]:
            del self.early[key]

    async def mesh_exchange(
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
        me, seq, mesh = self.rank, coll.seq, self.net.small.active
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
            self.slots[(seq, recv_phase)] = slot
            coll.waiting_on = set(expect)
            coll.data_elsewhere = True  # a goodbye on the control link may overtake our messages
            if self.early:
                for src in list(expect):
                    item = self.early.pop((seq, recv_phase, src), None)
                    if item is not None:
                        self.deliver(slot, src, *item)
        if self.early:
            self.check_early(coll)
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
                if self.rt.broken and not slot.done.done():
                    self.rt.check_usable()  # a peer was lost: raise, rather than wait on what may never come
                if mesh.spins and self.net.config.spin_us > 0 and PeerNet.live == 1 and not slot.done.done():
                    self._spin(slot)  # not with other ranks in this process: they could not run
                await slot.done
        finally:
            if slot is not None:
                mesh.release()
                del self.slots[(seq, recv_phase)]
        if mesh.backlog:
            await mesh.drain()

    def _spin(self, slot: _MeshSlot) -> None:
        """Poll the links slot waits on for up to PSRING_SPIN_US (the messages are usually close)."""
        mesh, members = self.net.small.unix, self.members
        assert mesh is not None
        peers = [members[s] for s in slot.expect]
        end = time.perf_counter() + self.net.config.spin_s
        done = slot.done
        while not done.done() and time.perf_counter() < end:
            if not mesh.poll(peers):
                os.sched_yield()

    async def direct(
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
        if self.net.small.active is not None and _call_bytes(coll.desc) <= MESH_MAX_BYTES:  # alike on every rank
            return await self.mesh_exchange(coll, x, phase, out, senders, receivers, recv_phase)
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

            post = self.ctx.mailbox.post
            for src in expect:
                dest = byte_view(out[src]) if out is not None and out[src].nbytes else None
                post((gid, seq, recv_phase, src), dest, arrived)
        targets = [d for d in receivers if d != me]
        conns = await self.ctx.links(targets) if targets else []
        if conns:
            header = frames.data(gid, seq, (phase, me), coll.desc, me)
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


def _call_bytes(desc: tuple[Any, ...]) -> int:
    """The size of a collective's input, from its descriptor (the same on every rank)."""
    dtype, shape = desc[1], desc[2]
    if dtype is None:
        return 0
    return prod(shape) * DTYPES[dtype].itemsize


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
