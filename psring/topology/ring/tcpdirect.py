"""The ring's small all_reduce between hosts, from the caller's thread over the TCP small-message links.

Between hosts a small all_reduce is one message from every rank to every other (the DIRECT one-hop
path), and the blocking API used to pay more for the trip to the event loop and back than for the
exchange. When the job has its TCP small-message links (psring.transport.tcpmesh) and nothing of the
group is in flight, :meth:`TcpDirect.soon` does it all on the caller's thread: it numbers the call,
sends its message to every peer, reads theirs straight off the sockets (blocking in ``poll``), and
folds in the canonical order -- the bits of every other path. Which calls take it depends only on the
call (the job's group, no compression, a DIRECT all_reduce: ring.paths), so every rank sends the same
messages whichever thread sends them; the event loop's path for the same call (ring.exchange) reads them
too.

Anything out of the ordinary -- a peer not there within ADOPT_AFTER, a message for another call or
another number, a link that ended, bytes the kernel did not take -- hands the call to the event loop
where it stands, and from there it is a collective like any other: timed out, reported when it
stalls, named as a mismatch, abandoned on an abort (the messages read so far are kept; what was not
read stays in the links for the loop to read).
"""

from __future__ import annotations

import os
import time
from sys import getrefcount
from typing import TYPE_CHECKING, Any

import numpy as np

from ...core import wire
from ...core.arrays import byte_view, dtype_name, pooled_empty
from ...core.fold import canonical_fold
from ...transport.shmboard import fold_kind
from ..now import Carry, Done, Now
from .constants import DIRECT, MESH_MAX_BYTES
from .context import RingPart
from .net import PeerNet
from .paths import Path

if TYPE_CHECKING:
    from .context import RingContext
    from .exchange import Exchange
    from .hier import Hierarchical
    from .shortways import ShortWays

#: seconds the caller's thread waits for its peers' messages before the event loop takes the call over
ADOPT_AFTER = 0.2
#: and how often, meanwhile, it looks whether the group failed (a lost peer, an abort)
LOOK_EVERY = 0.02
#: a lone rank in its process gives up its core this many times at most (within PSRING_SPIN_US) before
#: it sleeps in poll: a peer that shares the core runs and sends at once, and a rank that never slept
#: needs no waking (docs/defaults.md#the-callers-thread-over-tcp)
YIELDS = 16
#: the same for the native loop (TcpMesh.read, .exchange), whose rounds take a fraction of the Python
#: loop's, so more of them fit in a peer's answer
NATIVE_YIELDS = 64
#: the buffers a call receives into (a row a rank) and a two-hop call's result come from the buffer pool
#: from this size (a call alone in flight: from the group's scratch, ShortWays.alone_rows): a few hundred
#: KiB freed every call go back to the kernel and cost their page faults on every call
POOL_FROM = 64 << 10


class TcpDirect(RingPart):
    """The DIRECT route's short way between hosts (ring.onehop): a small all_reduce on the caller's thread
    over the TCP small-message links, or straight from the loop within its spin budget."""

    def __init__(self, ctx: RingContext, short: ShortWays, exchange: Exchange, hier: Hierarchical) -> None:
        super().__init__(ctx)
        self.short, self.exchange, self.hier = short, exchange, hier
        #: calls that ended here, those the loop took over, and of the first those that were one native
        #: call (TcpMesh.exchange)
        self.ran_now = 0
        self.adopted = 0
        self.ran_native = 0
        #: by size: whether an all_reduce of it takes this way
        self._direct: dict[int, bool] = {}
        #: by (dtype, shape, op): (call, its header by seq, the native fold's letter, the links in peer_order,
        #: its spin budget) where a call takes quick, else False
        self.plans: dict[tuple[Any, ...], tuple[Any, ...] | bool] = {}
        #: quick's last plan, result and rows (one kept at a time)
        self._last: tuple[Any, np.ndarray, np.ndarray] | None = None

    def soon(self, x: Any, op: str, on_loop: bool = False) -> Now:
        """(True, the result) when the call ended on the caller's thread; (False, a coroutine for the
        loop) when it must end there; None: not this call, or not now (take all_reduce).

        ``on_loop``: the caller is the event loop itself (the asyncio API), which must not sit in
        ``poll`` for long: it waits for its peers' messages only within its spin budget
        (PSRING_SPIN_US) and then goes on as a collective like any other."""
        mesh = self.net.small.tcp
        if (
            mesh is None
            or type(x) is not np.ndarray
            or mesh.holds
            or mesh.backlog
            or not self.short.idle(numbered=True)
        ):
            return None
        quick = self.quick(x, op, on_loop)
        if quick is not None:
            return quick
        nbytes = x.nbytes
        if not self.takes(nbytes):
            return None
        x, seq, desc, started = self.short.number(x, op)
        n_ranks, members = self.world_size, self.members
        bufs = pooled_empty(n_ranks * x.size, x.dtype, POOL_FROM).reshape(n_ranks, x.size)
        flat = x.reshape(-1)
        bufs[self.rank] = flat
        try:
            # one framed message for every peer; every peer's for this call begins with the same bytes
            frame = mesh.framed(wire.message_header((self.gid, seq, DIRECT, desc)), byte_view(x) if nbytes else None)
            expect = frame[: len(frame) - nbytes]
            sent = True
            missing = list(self.ctx.peer_order)  # not everyone to rank 0 first
            for d in missing:
                if not mesh.send_now(members[d], frame):
                    sent = False
            if self.exchange.early:  # messages the loop read for this call before it began
                for src in list(missing):
                    item = self.exchange.early.get((seq, DIRECT, src))
                    if item is not None and item[0] == desc and len(item[1]) == nbytes:
                        del self.exchange.early[(seq, DIRECT, src)]
                        byte_view(bufs[src])[:] = item[1]
                        missing.remove(src)
            if sent and missing:
                missing = self._read(expect, bufs, missing, on_loop)
        except BaseException as exc:
            self.short.books(seq, desc, started, exc)
            raise
        if missing or not sent:
            self.adopted += 1
            return Carry((self._adopt(seq, x, op, bufs, missing, started, flushed=sent),))
        try:
            out = canonical_fold(bufs, op, np.empty_like(flat), hosts=self.hier.hosts())
        except BaseException as exc:
            self.short.books(seq, desc, started, exc)
            raise
        self.short.books(seq, desc, started, None)
        self.ran_now += 1
        return Done((out.reshape(x.shape),))

    def quick(self, x: Any, op: str, on_loop: bool = False) -> Now:
        """soon's call whole in one native call (TcpMesh.exchange: send, read, fold in C) where the
        mesh is native, the C fold takes the call's dtype and op, and the call is not two-level; else
        None, and nothing was done. A call whose peers are late (past the spin; on the loop, past
        _read's wait), or whose messages are not all there or not all sent, goes on as soon's."""
        mesh = self.net.small.tcp
        if mesh is None or not mesh.native or type(x) is not np.ndarray:
            return None
        key = (x.dtype, x.shape, op)
        plan = self.plans.get(key)
        if plan is None:
            plan = False
            kind = fold_kind(x.dtype, op)
            if kind is not None and 0 < x.nbytes and self.takes(x.nbytes):
                desc = ("all_reduce", dtype_name(x.dtype), tuple(x.shape), op, None, None)
                links = [mesh.links[self.members[d]] for d in self.ctx.peer_order]
                plan = (
                    desc,
                    wire.header_maker(self.gid, DIRECT, desc),
                    kind,
                    links,
                    self.short.spin_budget(x.nbytes),
                )
            if len(self.plans) < 1024:
                self.plans[key] = plan
        if (
            plan is False
            or self.net.hosts is not None
            or mesh.holds
            or self.exchange.early
            or not x.flags.c_contiguous
            or not x.flags.aligned
            or not self.short.idle()
        ):
            return None
        desc, header, kind, links, budget = plan  # type: ignore[misc]
        if not mesh.usable(links):
            return None
        self.rt.check_usable()
        seq = self.rt.take_number()
        started = time.monotonic()
        # the rows and the result of the last call of this kind again, where the rows are still the scratch's
        # and nothing holds the result (as twohop's fast way: each numpy call costs, cold, a few us a call)
        last = self._last
        out = last[1] if last is not None and last[0] is plan else None
        # (references: the tuple's, `out`, the argument -- a view of it holds it too: it owns its memory)
        if last is not None and out is not None and getrefcount(out) == 3 and last[2].base is self.short.scratch:
            bufs = last[2]
        else:
            bufs = self.short.alone_rows(self.world_size, x.size, x.dtype)
            out = np.empty_like(x)
            self._last = (plan, out, bufs)
        head = mesh.head(header(seq), x.nbytes)
        missing = list(self.ctx.peer_order)
        spin = self.net.config.spin_us > 0 and PeerNet.live == 1
        if not spin:
            budget = 0.0
        wait = (budget if PeerNet.live == 1 else 0.0) if on_loop else LOOK_EVERY
        yields = NATIVE_YIELDS if spin else 0
        try:
            code = mesh.exchange(list(links), missing, head, x, bufs, self.rank, out, kind, op, yields, budget, wait)
            if code == 1 and not on_loop:  # late peers: wait on, as soon does
                missing = self._read(head, bufs, missing)
                code = 1 if missing else 0
                if not missing:
                    out = canonical_fold(bufs, op, out.reshape(-1)).reshape(x.shape)
        except BaseException as exc:
            self.short.books(seq, desc, started, exc)
            raise
        if code == 0:
            self.short.books(seq, desc, started, None)
            self.ran_now += 1
            self.ran_native += 1
            return Done((out,))
        self.adopted += 1
        return Carry((self._adopt(seq, x, op, bufs, missing, started, flushed=code != 4),))

    def takes(self, nbytes: int) -> bool:
        """Whether an all_reduce of ``nbytes`` takes the caller's-thread way (the job's group, a DIRECT
        size): the same on every rank, for any call of that size."""
        direct = self._direct.get(nbytes)
        if direct is None:  # the path depends on the size alone here (the job's group, a DIRECT size)
            direct = (
                self.gid == "0"
                and nbytes <= MESH_MAX_BYTES
                and self.ctx.loop_path(nbytes) is Path.DIRECT
                and nbytes < self.net.paths.plane_min  # (a larger size's path follows the plane's state)
            )
            if len(self._direct) < 1024:
                self._direct[nbytes] = direct
        return direct

    def _read(self, expect: bytes, bufs: np.ndarray, missing: list[int], on_loop: bool = False) -> list[int]:
        """Read the peers' messages for this call (each begins with the bytes ``expect``) off their
        links into ``bufs``; the local ranks still missing when something is out of the ordinary or
        ADOPT_AFTER passed (the spin budget on the loop: left for the loop to read)."""
        mesh = self.net.small.tcp
        assert mesh is not None
        links = [mesh.links[self.members[r]] for r in missing]
        row = bufs.shape[1] * bufs.itemsize
        # the loop waits only within its spin budget, and not at all for ranks that share it (in this process)
        wait = (self.short.spin_budget(row) if PeerNet.live == 1 else 0.0) if on_loop else ADOPT_AFTER
        end = time.monotonic() + wait
        # a lone rank in its process yields its core a few times before it sleeps in poll (YIELDS)
        spin = self.net.config.spin_us > 0 and PeerNet.live == 1
        spin_end = time.perf_counter() + self.short.spin_budget(row) if spin else 0.0
        if mesh.native:  # the same loop in C (psring._native), the GIL released
            yields, budget = (NATIVE_YIELDS, self.short.spin_budget(row)) if spin else (0, 0.0)
            while True:
                code = mesh.read(links, missing, expect, bufs, yields, budget, min(end - time.monotonic(), LOOK_EVERY))
                if code != 1 or time.monotonic() >= end or self.rt.interrupted:
                    return missing
                yields, budget = 0, 0.0
        yields = 0
        while True:
            for i in range(len(links) - 1, -1, -1):
                link = links[i]
                payload = mesh.take(link, expect, row)
                if payload is None:
                    if mesh.fill(link) < 0:
                        return missing  # ended: the loop reads its end and names it
                    payload = mesh.take(link, expect, row)
                    if payload is None:
                        if mesh.peek(link) is not None:
                            return missing  # a whole message for another call, number or size: the loop's
                        continue
                byte_view(bufs[missing[i]])[:] = payload
                del links[i], missing[i]
            if not missing:
                return missing
            left = end - time.monotonic()
            if left <= 0 or self.rt.interrupted:
                return missing
            if spin_end and yields < YIELDS and time.perf_counter() < spin_end:
                yields += 1
                os.sched_yield()  # a peer that shares this core sends sooner, and no sleep to wake from
                continue
            mesh.wait(links, min(left, LOOK_EVERY))

    async def _adopt(
        self,
        seq: int,
        x: np.ndarray,
        op: str,
        bufs: np.ndarray,
        missing: list[int],
        started: float,
        flushed: bool,
    ) -> np.ndarray:
        """A call soon numbered and sent, whose peers' messages did not all come its way: from here
        on a collective like any other (deadline, stall reports, aborts, mismatches named)."""
        mesh = self.net.small.tcp
        assert mesh is not None
        if not flushed:
            mesh.flush()
        coll = self.rt.begin("all_reduce", x, op, seq=seq, started=started)
        return await self.rt.run(coll, self._rest(coll, x, op, bufs, missing))

    async def _rest(self, coll: Any, x: np.ndarray, op: str, bufs: np.ndarray, missing: list[int]) -> np.ndarray:
        if missing:
            await self.exchange.direct(coll, None, DIRECT, bufs, [self.rank, *missing], [])
        elif self.net.small.tcp is not None and self.net.small.tcp.backlog:
            await self.net.small.tcp.drain()
        out = canonical_fold(bufs, op, np.empty(x.size, x.dtype), hosts=self.hier.hosts())
        return out.reshape(x.shape)
