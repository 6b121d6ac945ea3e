"""The ring's small all_reduce between hosts, from the caller's thread over the TCP small-message links.

Between hosts a small all_reduce is one message from every rank to every other (the DIRECT one-hop
path), and the blocking API used to pay more for the trip to the event loop and back than for the
exchange. When the job has its TCP small-message links (psring.transport.tcpmesh) and nothing of the
group is in flight, :meth:`TcpNow._tcp_soon` does it all on the caller's thread: it numbers the call,
sends its message to every peer, reads theirs straight off the sockets (blocking in ``poll``), and
folds in the canonical order -- the bits of every other path. Which calls take it depends only on the
call (the job's group, no compression, a DIRECT all_reduce: ring.paths), so every rank sends the same
messages whichever thread sends them; the event loop's path for the same call (small.py) reads them
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
from ...transport.board import fold_kind
from .constants import DIRECT, MESH_MAX_BYTES
from .net import PeerNet
from .paths import Path

if TYPE_CHECKING:
    from .host import RingHost as _Host
else:
    _Host = object

#: seconds the caller's thread waits for its peers' messages before the event loop takes the call over
ADOPT_AFTER = 0.2
#: and how often, meanwhile, it looks whether the group failed (a lost peer, an abort)
LOOK_EVERY = 0.02
#: a lone rank in its process gives up its core this many times at most (within PSRING_SPIN_US) before
#: it sleeps in poll: a peer that shares the core runs and sends at once, and a rank that never slept
#: needs no waking (measured, 4 B at 4 ranks on 2 cores: about 350 us a call, against 490 asleep at once;
#: between 10 and 30 the difference is in the noise)
YIELDS = 16
#: the same for the native loop (TcpMesh.read, .exchange), whose rounds take a fraction of the Python
#: loop's: 16 of them were over before a peer on another core answered (4 B at 2 ranks: 18 us a call
#: against 10.8 with 64; at 4 ranks on 2 cores 52 against 50)
NATIVE_YIELDS = 64
#: the buffers a call receives into (a row a rank) and a two-hop call's result come from the buffer pool
#: from this size (a call alone in flight: from the group's scratch, TcpNow._alone_rows): a few hundred KiB
#: freed every call went back to the kernel and cost their page faults on every call (4 ranks over TCP: 33
#: a call for 64 KiB's rows, 272-285 us a call against 211-219 without; two hops: 97 a call at 256 KiB)
POOL_FROM = 64 << 10


class TcpNow(_Host):
    """Part of :class:`~psring.topology.ring.group.RingGroup`: small all_reduces between hosts from the
    caller's thread."""

    #: by size: whether an all_reduce of it takes this way (set in RingGroup.__init__)
    _tcp_direct: dict[int, bool]
    #: the peers in the order this rank sends to them (set in RingGroup.__init__)
    _tcp_order: tuple[int, ...]
    #: the rows of the calls alone in flight (_alone_rows)
    _scratch: np.ndarray | None
    #: by (dtype, shape, op): (call, its header by seq, the native fold's letter, the links in _tcp_order,
    #: its spin budget) where a call takes _tcp_quick, else False (set in RingGroup.__init__)
    _tcp_plans: dict[tuple[Any, ...], tuple[Any, ...] | bool]
    #: _tcp_quick's last plan, result and rows (one kept at a time)
    _tcp_last: tuple[Any, np.ndarray, np.ndarray] | None

    def _tcp_soon(
        self, x: Any, op: str, compression: str | None, on_loop: bool = False
    ) -> tuple[bool, Any] | None:
        """(True, the result) when the call ended on the caller's thread; (False, a coroutine for the
        loop) when it must end there; None: not this call, or not now (take all_reduce).

        ``on_loop``: the caller is the event loop itself (the asyncio API), which must not sit in
        ``poll`` for long: it waits for its peers' messages only within its spin budget
        (PSRING_SPIN_US) and then goes on as a collective like any other."""
        mesh = self.net.tcp_mesh
        if (
            mesh is None
            or compression is not None
            or type(x) is not np.ndarray
            or mesh.holds
            or mesh.backlog
            or not self._idle()
        ):
            return None
        quick = self._tcp_quick(x, op, compression, on_loop)
        if quick is not None:
            return quick
        nbytes = x.nbytes
        if not self._tcp_takes(nbytes):
            return None
        x, seq, desc, started = self._number_now(x, op)
        n_ranks, members = self.world_size, self.members
        bufs = pooled_empty(n_ranks * x.size, x.dtype, POOL_FROM).reshape(n_ranks, x.size)
        flat = x.reshape(-1)
        bufs[self.rank] = flat
        try:
            # one framed message for every peer; every peer's for this call begins with the same bytes
            frame = mesh.framed(wire.message_header((self.gid, seq, DIRECT, desc)), byte_view(x) if nbytes else None)
            expect = frame[: len(frame) - nbytes]
            sent = True
            missing = list(self._tcp_order)  # not everyone to rank 0 first
            for d in missing:
                if not mesh.send_now(members[d], frame):
                    sent = False
            if self._mesh_early:  # messages the loop read for this call before it began
                for src in list(missing):
                    item = self._mesh_early.get((seq, DIRECT, src))
                    if item is not None and item[0] == desc and len(item[1]) == nbytes:
                        del self._mesh_early[(seq, DIRECT, src)]
                        byte_view(bufs[src])[:] = item[1]
                        missing.remove(src)
            if sent and missing:
                missing = self._tcp_read(expect, bufs, missing, on_loop)
        except BaseException as exc:
            self._books_now(seq, desc, started, exc)
            raise
        if missing or not sent:
            self.tcp_adopted += 1
            return False, self._tcp_adopt(seq, x, op, bufs, missing, started, flushed=sent)
        try:
            out = canonical_fold(bufs, op, np.empty_like(flat), hosts=self._hier_hosts())
        except BaseException as exc:
            self._books_now(seq, desc, started, exc)
            raise
        self._books_now(seq, desc, started, None)
        self.tcp_now += 1
        return True, out.reshape(x.shape)

    def _alone_rows(self, n: int, count: int, dtype: np.dtype) -> np.ndarray:
        """``n`` rows of ``count`` elements (uninitialized) for a call alone in flight -- the caller's
        thread's, or the loop's while nothing else of the group is active -- in one buffer the group keeps
        and grows: such a call pays neither page faults nor the buffer pool's upkeep (which cost a 32 KiB
        call over TCP at 4 ranks ~12 us of CPU, cold after the call's copies). A call alone ends (or is
        adopted and ends on the loop) before the next begins, so one buffer serves all of them."""
        nbytes = n * count * dtype.itemsize
        buf = self._scratch
        if buf is None or buf.nbytes < nbytes:
            buf = self._scratch = np.empty(nbytes, np.uint8)
        return buf[:nbytes].view(dtype).reshape(n, count)

    def _tcp_quick(self, x: Any, op: str, compression: str | None, on_loop: bool = False) -> tuple[bool, Any] | None:
        """_tcp_soon's call whole in one native call (TcpMesh.exchange: send, read, fold in C) where the
        mesh is native, the C fold takes the call's dtype and op, and the call is not two-level; else
        None, and nothing was done. A call whose peers are late (past the spin; on the loop, past
        _tcp_read's wait), or whose messages are not all there or not all sent, goes on as _tcp_soon's."""
        mesh = self.net.tcp_mesh
        if mesh is None or not mesh.native or compression is not None or type(x) is not np.ndarray:
            return None
        key = (x.dtype, x.shape, op)
        plan = self._tcp_plans.get(key)
        if plan is None:
            plan = False
            kind = fold_kind(x.dtype, op)
            if kind is not None and 0 < x.nbytes and self._tcp_takes(x.nbytes):
                desc = ("all_reduce", dtype_name(x.dtype), tuple(x.shape), op, None)
                links = [mesh.links[self.members[d]] for d in self._tcp_order]
                plan = (desc, wire.header_maker(self.gid, DIRECT, desc), kind, links, self._spin_budget(x.nbytes))
            if len(self._tcp_plans) < 1024:
                self._tcp_plans[key] = plan
        if (
            plan is False
            or self.net.hosts is not None
            or mesh.holds
            or self._mesh_early
            or not x.flags.c_contiguous
            or not x.flags.aligned
            or not self._idle()
        ):
            return None
        desc, header, kind, links, budget = plan  # type: ignore[misc]
        if not mesh.usable(links):
            return None
        self._check_usable()
        seq = self._seq
        self._seq += 1
        self._reserved.add(seq)
        started = time.monotonic()
        # the rows and the result of the last call of this kind again, where the rows are still the scratch's
        # and nothing holds the result (as twohop's fast way: each numpy call costs, cold, a few us a call)
        last = self._tcp_last
        out = last[1] if last is not None and last[0] is plan else None
        # (references: the tuple's, `out`, the argument -- a view of it holds it too: it owns its memory)
        if last is not None and out is not None and getrefcount(out) == 3 and last[2].base is self._scratch:
            bufs = last[2]
        else:
            bufs = self._alone_rows(self.world_size, x.size, x.dtype)
            out = np.empty_like(x)
            self._tcp_last = (plan, out, bufs)
        head = mesh.head(header(seq), x.nbytes)
        missing = list(self._tcp_order)
        spin = self.net.config.spin_us > 0 and PeerNet.live == 1
        if not spin:
            budget = 0.0
        wait = (budget if PeerNet.live == 1 else 0.0) if on_loop else LOOK_EVERY
        yields = NATIVE_YIELDS if spin else 0
        try:
            code = mesh.exchange(list(links), missing, head, x, bufs, self.rank, out, kind, op, yields, budget, wait)
            if code == 1 and not on_loop:  # late peers: wait on, as _tcp_soon does
                missing = self._tcp_read(head, bufs, missing)
                code = 1 if missing else 0
                if not missing:
                    out = canonical_fold(bufs, op, out.reshape(-1)).reshape(x.shape)
        except BaseException as exc:
            self._books_now(seq, desc, started, exc)
            raise
        if code == 0:
            self._books_now(seq, desc, started, None)
            self.tcp_now += 1
            self.tcp_native += 1
            return True, out
        self.tcp_adopted += 1
        return False, self._tcp_adopt(seq, x, op, bufs, missing, started, flushed=code != 4)

    def _tcp_takes(self, nbytes: int) -> bool:
        """Whether an all_reduce of ``nbytes`` takes the caller's-thread way (the job's group, a DIRECT
        size): the same on every rank, for any call of that size."""
        direct = self._tcp_direct.get(nbytes)
        if direct is None:  # the path depends on the size alone here (the job's group, a DIRECT size)
            direct = (
                self.gid == "0"
                and nbytes <= MESH_MAX_BYTES
                and self._all_reduce_path(nbytes) is Path.DIRECT
                and nbytes < self.net.paths.plane_min  # (a larger size's path follows the plane's state)
            )
            if len(self._tcp_direct) < 1024:
                self._tcp_direct[nbytes] = direct
        return direct

    def _tcp_read(self, expect: bytes, bufs: np.ndarray, missing: list[int], on_loop: bool = False) -> list[int]:
        """Read the peers' messages for this call (each begins with the bytes ``expect``) off their
        links into ``bufs``; the local ranks still missing when something is out of the ordinary or
        ADOPT_AFTER passed (the spin budget on the loop: left for the loop to read)."""
        mesh = self.net.tcp_mesh
        assert mesh is not None
        links = [mesh.links[self.members[r]] for r in missing]
        row = bufs.shape[1] * bufs.itemsize
        # the loop waits only within its spin budget, and not at all for ranks that share it (in this process)
        wait = (self._spin_budget(row) if PeerNet.live == 1 else 0.0) if on_loop else ADOPT_AFTER
        end = time.monotonic() + wait
        # a lone rank in its process yields its core a few times before it sleeps in poll (YIELDS)
        spin = self.net.config.spin_us > 0 and PeerNet.live == 1
        spin_end = time.perf_counter() + self._spin_budget(row) if spin else 0.0
        if mesh.native:  # the same loop in C (psring._native), the GIL released
            yields, budget = (NATIVE_YIELDS, self._spin_budget(row)) if spin else (0, 0.0)
            while True:
                code = mesh.read(links, missing, expect, bufs, yields, budget, min(end - time.monotonic(), LOOK_EVERY))
                if code != 1 or time.monotonic() >= end or self._broken is not None or self._aborted or self._closed:
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
            if left <= 0 or self._broken is not None or self._aborted or self._closed:
                return missing
            if spin_end and yields < YIELDS and time.perf_counter() < spin_end:
                yields += 1
                os.sched_yield()  # a peer that shares this core sends sooner, and no sleep to wake from
                continue
            mesh.wait(links, min(left, LOOK_EVERY))

    async def _tcp_adopt(
        self,
        seq: int,
        x: np.ndarray,
        op: str,
        bufs: np.ndarray,
        missing: list[int],
        started: float,
        flushed: bool,
    ) -> np.ndarray:
        """A call _tcp_soon numbered and sent, whose peers' messages did not all come its way: from here
        on a collective like any other (deadline, stall reports, aborts, mismatches named)."""
        mesh = self.net.tcp_mesh
        assert mesh is not None
        if not flushed:
            mesh.flush()
        coll = self._begin("all_reduce", x, op, seq=seq)
        coll.started, coll.deadline = started, started + self.timeout
        return await self._run(coll, self._tcp_rest(coll, x, op, bufs, missing))

    async def _tcp_rest(
        self, coll: Any, x: np.ndarray, op: str, bufs: np.ndarray, missing: list[int]
    ) -> np.ndarray:
        if missing:
            await self._direct_exchange(coll, None, DIRECT, bufs, [self.rank, *missing], [])
        elif self.net.tcp_mesh is not None and self.net.tcp_mesh.backlog:
            await self.net.tcp_mesh.drain()
        out = canonical_fold(bufs, op, np.empty(x.size, x.dtype), hosts=self._hier_hosts())
        return out.reshape(x.shape)
