"""The ring's medium all_reduce between hosts: two hops over the TCP small-message links.

Over TCP a ring all_reduce of N ranks waits on its left neighbour 2(N-1) times a call, and with more
ranks than cores each wait is a trip through the scheduler. Here every rank sends ring chunk d of its
tensor to rank d (one message each, all at once), rank d folds the N copies of its chunk in the
canonical order -- the chunk's own order, from rank d on, as the ring folds it -- and sends the folded
chunk to every rank: two waits a call, the same bytes as the ring (2(N-1)/N of the tensor each way).
The links are the job's TCP small-message links (psring.transport.tcpmesh), whose buffers grow for a
chunk; payloads are read straight into place (psring._native.tcp_scatter). Which calls take it depends
only on the call (ring.paths: the job's group of 4 ranks or more, from PSRING_RING_TWO_HOP_MIN up to
PSRING_RING_TWO_HOP), so every rank sends the same messages whichever thread sends them.

A blocking caller with nothing of the group in flight runs the whole call on its own thread
(:meth:`TwoHop.soon`), as ring.tcpdirect does for the one-hop call; the event loop runs it in C
too while its peers are there within its spin budget. Anything out of the ordinary -- a peer not there
within ADOPT_AFTER, a message for another call, a link that ended, bytes the kernel did not take --
hands the call to the event loop where it stands (what was sent and read so far is kept; what was not
sent is queued on the links; a message half read is left in its link's buffer), and from there it is
a collective like any other: timed out, reported when it stalls, named as a mismatch, abandoned on an
abort.
"""

from __future__ import annotations

import time
from sys import getrefcount
from typing import TYPE_CHECKING, Any

import numpy as np

from ...core import wire
from ...core.arrays import byte_view, dtype_name, pooled_empty, result_empty
from ...core.fold import canonical_fold, ring_chunk_bounds
from ...transport.shmboard import fold_kind
from ...transport.tcpmesh import TcpMesh
from ..collective import Collective
from ..now import Carry, Done, Now
from .chooser import Algorithm, Call
from .constants import TWO_GATHER, TWO_SCATTER
from .net import PeerNet
from .paths import Path
from .tcpdirect import ADOPT_AFTER, LOOK_EVERY, POOL_FROM

try:  # the C fold of one ring chunk (psring/native/twohop.c, a leaf: it imports nothing of psring)
    from ..._native import fold_chunk as _fold_chunk
except ImportError:  # not built here: numpy's fold, the same bits
    _fold_chunk = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from .context import RingContext
    from .exchange import Exchange
    from .shortways import ShortWays

#: with nothing to do a lone rank in its process gives up its core this many times (counted again after
#: each move) before it sleeps in poll, as the data plane's native ring does (dataplane.NATIVE_HOT)
HOT = 64


class _Plan:
    """What every two-hop call of one (dtype, shape, op) shares."""

    __slots__ = (
        "bounds",
        "desc",
        "edges",
        "fast",
        "kind",
        "links",
        "makers",
        "native",
        "order",
        "reserved",
        "room",
        "takes",
    )

    def __init__(self, group: TwoHop, x: np.ndarray, op: str, shape: tuple[int, ...], after: int | None) -> None:
        #: the call's own shape (x may be flat); after: what the call before it was (collective.after_of)
        self.desc = ("all_reduce", dtype_name(x.dtype), shape, op, None, after)
        self.kind = fold_kind(x.dtype, op)
        self.bounds = ring_chunk_bounds(x.size, group.world_size)
        self.makers = {phase: wire.header_maker(group.gid, phase, self.desc) for phase in (TWO_SCATTER, TWO_GATHER)}
        #: whether a call of this size takes two hops (ring.paths: the same for every call of it)
        self.takes = group.ctx.loop_path(x.nbytes) is Path.TWO_HOP
        item = x.itemsize
        a, b = self.bounds[group.rank]
        #: the whole call goes in one native call (the fold between the phases in C too)
        self.native = self.kind is not None and _fold_chunk is not None and b > a
        #: for that call (TcpMesh.two_hop): the links in peer_order, the ranks they go to and every rank's
        #: chunk in bytes, as int64 bytes; the room a link's buffer needs for the largest message, made by
        #: the first such call (where nothing else reads the links: not here, on whichever thread)
        mesh = group.net.small.tcp
        self.links = [mesh.links[group.members[p]] for p in group.ctx.peer_order] if self.takes and mesh else []
        self.order = np.array(group.ctx.peer_order, np.int64).tobytes()
        self.edges = np.array([(a * item, b * item) for a, b in self.bounds], np.int64).tobytes()
        longest = max(b - a for a, b in self.bounds) * item
        most = len(self.makers[TWO_GATHER]((1 << 64) - 1))  # the longest header (a plan of any size is made)
        self.room = 4 + most + longest  # (a message: its length, the header, the payload)
        self.reserved = False
        #: later calls of this kind (either API) may take fast: set once a call of it was numbered
        #: on the short way (so its dtype and op were checked, its links are the mesh's)
        self.fast = False


class _Call:
    """One two-hop all_reduce under way: what it sends and reads, and how far it got."""

    __slots__ = ("bounds", "desc", "flat", "kind", "left", "makers", "messages", "op", "out", "phase", "rows", "seq")

    def __init__(
        self,
        group: TwoHop,
        seq: int,
        x: np.ndarray,
        op: str,
        plan: _Plan,
        alone: bool = False,
        rows: np.ndarray | None = None,
        out: np.ndarray | None = None,
    ):
        self.desc, self.kind, self.bounds, self.makers = plan.desc, plan.kind, plan.bounds, plan.makers
        self.seq, self.op = seq, op
        self.flat = x.reshape(-1)
        a, b = self.bounds[group.rank]
        n = len(self.bounds)
        #: chunk `me` of every rank's tensor (this rank's own row unused: the fold reads it from x); a call
        #: alone in flight (nothing else of the group active when it began) uses the group's scratch
        if rows is not None:
            self.rows = rows
        elif alone:
            self.rows = group.short.alone_rows(n, b - a, x.dtype)
        else:
            self.rows = pooled_empty(n * (b - a), x.dtype, POOL_FROM).reshape(n, b - a)
        self.out = result_empty(self.flat, POOL_FROM) if out is None else out.reshape(-1)
        self.phase = TWO_SCATTER
        #: the peers (local ranks) whose message of this phase is still to be read
        self.left: list[int] = []
        #: this phase's message to each peer not sent whole yet: [peer, head, payload, bytes sent]
        self.messages: list[list[Any]] = []


class TwoHop(Algorithm):
    """Medium all_reduces between hosts in two hops over the TCP small-message links (ring.chooser's
    TWO_HOP route): from the caller's thread or the loop (:meth:`soon`), or as a collective (:meth:`run`)."""

    route = Path.TWO_HOP
    holds_caller = True

    def __init__(self, ctx: RingContext, short: ShortWays, exchange: Exchange) -> None:
        super().__init__(ctx)
        self.short, self.exchange = short, exchange
        #: calls that ended on the caller's thread, those the loop took over from it, and those the loop
        #: ran from their start (the asyncio API, the torch backend's, calls beside others); of the first,
        #: those that took fast whole
        self.ran_now = 0
        self.adopted = 0
        self.ran_on_loop = 0
        self.ran_fast = 0
        #: by (dtype, shape, op): what every call of that kind shares
        self.plans: dict[tuple[Any, ...], _Plan] = {}
        #: fast's last plan, result and rows: the next call of that plan fills the result again if the
        #: caller let go of it (and of every view of it), and uses the rows while they are the group's scratch
        self._last: tuple[_Plan, np.ndarray, np.ndarray] | None = None

    def eligible(self, call: Call) -> bool:
        return call.world and self.net.paths.two_hop(call.nbytes, self.world_size)

    def soon(self, x: np.ndarray, op: str, on_loop: bool = False) -> Now:
        """The kind of call that took two hops whole before goes the fastest way (fast); else _soon."""
        if self.plans:
            quick = self.fast(x, op, on_loop)
            if quick is not None:
                return quick
        return self._soon(x, op, on_loop)

    def _plan(self, x: np.ndarray, op: str, shape: tuple[int, ...], after: int | None = None) -> _Plan:
        """The plan of a call of x (any shape: the loop's is flat) whose caller's tensor has ``shape``
        (``after``: its descriptor's last field; only the loop's calls have one)."""
        key: tuple[Any, ...] = (x.dtype, shape, op) if after is None else (x.dtype, shape, op, after)
        plan = self.plans.get(key)
        if plan is None:
            plan = _Plan(self, x, op, shape, after)
            if len(self.plans) < 1024:
                self.plans[key] = plan
        return plan

    # ------------------------------------------------------------------ the caller's thread
    def _soon(self, x: Any, op: str, on_loop: bool = False) -> Now:
        """(True, the result) when the call ended on the caller's thread; (False, a coroutine for the
        loop) when it must end there; None: not this call, or not now (take all_reduce).

        ``on_loop``: the caller is the event loop itself (the asyncio API), as in TcpDirect.soon: it waits for
        its peers only within its spin budget (not at all for ranks in this process), then goes on as a
        collective (the Collective machinery before a call was most of the asyncio API's cost at 64 KiB)."""
        mesh = self.net.small.tcp
        if (
            mesh is None
            or not mesh.native
            or type(x) is not np.ndarray
            or self.gid != "0"
            or mesh.holds
            or mesh.backlog
            or self.exchange.early
            or not self.short.idle(numbered=True)
            or not self.net.paths.two_hop(x.nbytes, self.world_size)  # (no plan for a size it never takes)
        ):
            return None
        plan = self._plan(x, op, x.shape, self.rt.after)  # (the after number() gives it)
        if not plan.takes or not mesh.usable(plan.links):
            return None
        x, seq, desc, started = self.short.number(x, op)
        # (its dtype and op checked: later calls of this kind may take fast)
        plan.fast = plan.native and self.net.board is None
        call = _Call(self, seq, x, op, plan, alone=True)
        end = time.monotonic() + ADOPT_AFTER
        hot = HOT if PeerNet.live == 1 else 0
        wait = LOOK_EVERY
        if on_loop:  # (no waiting beyond the first native call)
            wait = self.short.spin_budget(x.nbytes) if self.net.config.spin_us > 0 and PeerNet.live == 1 else 0.0
            end = 0.0
        try:
            code = self._first(call, plan, mesh, hot, wait) if plan.native else 1
        except BaseException as exc:
            self.short.books(seq, desc, started, exc)
            raise
        return self._then(call, x, started, code, hot, end)

    def fast(self, x: np.ndarray, op: str, on_loop: bool = False) -> Now:
        """_soon for a kind of call (dtype, shape, op) that took two hops whole on the caller's thread
        before: the same checks and books with as little Python around the native call as can be (``on_loop``:
        the asyncio API's call, from the loop, as _soon's). Over TCP the Python around the native call
        runs cold (the call's socket copies leave nothing of it in the caches) and was a measurable share
        of a rank's CPU on cores the ranks share (docs/design.md). None: not now,
        nothing done (the usual way decides)."""
        plan = self.plans.get((x.dtype, x.shape, op))
        if plan is None or not plan.fast:
            return None
        mesh = self.net.small.tcp
        if (
            mesh is None
            or mesh.holds
            or mesh.backlog
            or self.exchange.early
            or not self.short.idle()
            or self.rt.troubled  # (what check_usable would raise for, or let run: the usual way does that)
            or not x.flags.c_contiguous
            or not mesh.usable(plan.links)
        ):
            return None
        seq = self.rt.take_number()
        started = time.monotonic()
        # the result: the last one again where nothing holds it or its memory any more (a memoryview or a
        # torch tensor of it holds the array; a view or a reshape, the array's base), else a pooled one -- a
        # pooled result costs CPU cold (its base, its interface read by numpy, its return to the pool);
        # one is kept at a time, with its rows (the group's scratch, while it is that)
        last = self._last
        out = last[1] if last is not None and last[0] is plan else None
        base = out.base if out is not None else None
        # (references: the tuple's, `out`, the argument; the base: the array's, `base`, the argument)
        if out is None or getrefcount(out) != 3 or (base is not None and getrefcount(base) != 3):
            out = result_empty(x, POOL_FROM)  # (shaped as x)
            last = None
        if last is not None and last[2].base is self.short.scratch:
            rows = last[2]
        else:
            a, b = plan.bounds[self.rank]
            rows = self.short.alone_rows(len(plan.bounds), b - a, x.dtype)
            self._last = (plan, out, rows)
        hot = HOT if PeerNet.live == 1 else 0
        wait = LOOK_EVERY
        if on_loop:  # (as _soon's: within the spin budget, and no waiting beyond the native call)
            wait = self.short.spin_budget(x.nbytes) if self.net.config.spin_us > 0 and PeerNet.live == 1 else 0.0
        makers, kind = plan.makers, plan.kind
        assert kind is not None  # (plan.fast: plan.native)
        try:
            code, sent, read, phase = mesh.two_hop(
                plan.links, x, out, rows, plan.order, plan.edges, self.rank,
                makers[TWO_SCATTER](seq), makers[TWO_GATHER](seq), kind, op, hot, wait,
            )  # fmt: skip
            if code == 0 and phase == 2:
                self.short.books(seq, plan.desc, started, None)
                self.ran_now += 1
                self.ran_fast += 1
                return Done((out,))
            call = _Call(self, seq, x, op, plan, rows=rows, out=out)
            self._stopped(call, code, sent, read, phase)
        except BaseException as exc:
            self.short.books(seq, plan.desc, started, exc)
            raise
        return self._then(call, x, started, code, hot, 0.0 if on_loop else time.monotonic() + ADOPT_AFTER)

    def _then(self, call: _Call, x: np.ndarray, started: float, code: int, hot: int, end: float) -> Done | Carry:
        """A call of the caller's thread after its first native call stopped with ``code``: driven on
        there until ``end``, then ended, or handed to the loop where it stands."""
        try:
            if code == 1 and call.phase == TWO_SCATTER and not call.messages and not call.left:
                self._start(call)  # (not begun: the general way)
            while code == 1:
                if time.monotonic() >= end or self.rt.interrupted:
                    break
                code = self._drive(call, min(end - time.monotonic(), LOOK_EVERY), hot)
        except BaseException as exc:
            self.short.books(call.seq, call.desc, started, exc)
            raise
        if code == 0:
            self.short.books(call.seq, call.desc, started, None)
            self.ran_now += 1
            return Done((call.out.reshape(x.shape),))
        self.adopted += 1
        return Carry((self._adopt(call, x, started),))

    async def _adopt(self, call: _Call, x: np.ndarray, started: float) -> Any:
        coll = self.rt.begin("all_reduce", x, call.op, seq=call.seq, started=started)
        out = await self.rt.run(coll, self._rest(coll, call))
        return out.reshape(x.shape)

    # ---------------------------------------------------------------------- the loop
    async def run(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray:
        """The two-hop all_reduce as a collective on the loop: in C on the loop's thread while the
        messages move within its spin budget (PSRING_SPIN_US), then on the loop's own reading."""
        x = x.reshape(-1)
        plan = self._plan(x, op, coll.desc[2], coll.desc[5])
        self.ran_on_loop += 1
        # (nothing else of the group active, and no call of a caller's thread under way: _reserved)
        call = _Call(self, coll.seq, x, op, plan, alone=self.rt.alone())
        mesh = self.net.small.tcp
        if (
            mesh is not None
            and mesh.native
            and not self.rt.numbered_ahead  # (a caller's thread may be reading the links)
            and not mesh.holds
            and not mesh.backlog
            and not self.exchange.early
            and mesh.usable(list(mesh.links.values()))
            and self.net.config.spin_us > 0
            and PeerNet.live == 1  # (ranks that share this loop could not answer meanwhile)
        ):
            if plan.native:
                self._first(call, plan, mesh, HOT, self.short.spin_budget(x.nbytes))
            else:
                self._start(call)
                self._drive(call, self.short.spin_budget(x.nbytes), HOT)
        else:
            self._start(call)
        return await self._rest(coll, call)

    async def _rest(self, coll: Collective, call: _Call) -> np.ndarray:
        """The call on from where it stands, on the loop: what was not sent queued on the links, the
        messages not read yet read there."""
        mesh = self.net.small.tcp
        assert mesh is not None
        self._queue(call, mesh)
        if call.phase == TWO_SCATTER:
            if call.left:
                await self.exchange.mesh_exchange(coll, None, TWO_SCATTER, call.rows, call.left, [], TWO_SCATTER)
            self._fold(call)
            call.left = list(self.ctx.peer_order)
            call.phase, call.messages = TWO_GATHER, []
            a, b = call.bounds[self.rank]
            mine: np.ndarray | None = call.out[a:b]
            receivers = call.left
        else:
            mine, receivers = None, []
        if call.left or receivers:
            item = call.flat.itemsize
            spans = {p: (a * item, (b - a) * item) for p, (a, b) in enumerate(call.bounds)}
            await self.exchange.mesh_exchange(
                coll, mine, TWO_GATHER, call.out, call.left, receivers, TWO_GATHER, spans=spans
            )
        if mesh.backlog:
            await mesh.drain()
        return call.out

    # ------------------------------------------------------------------ both
    def _start(self, call: _Call) -> None:
        """The first phase's messages: chunk d of the tensor to each rank d."""
        mesh = self.net.small.tcp
        assert mesh is not None
        item, flat = call.flat.itemsize, call.flat
        header = call.makers[TWO_SCATTER](call.seq)
        call.left = list(self.ctx.peer_order)
        call.messages = []
        for p in self.ctx.peer_order:
            a, b = call.bounds[p]
            call.messages.append([p, mesh.head(header, (b - a) * item), byte_view(flat[a:b]), 0])

    def _first(self, call: _Call, plan: _Plan, mesh: TcpMesh, hot: int, wait: float = LOOK_EVERY) -> int:
        """A call's first native call, both phases and the fold, its messages made in C from the plan
        (TcpMesh.two_hop: the usual case, every peer there within ``wait``); where it stops, the call's
        books say where."""
        links = plan.links
        if any(link.closed for link in links):  # (its socket is gone: the loop names the loss)
            self._start(call)
            return 3
        if not plan.reserved:  # (a link's buffer only grows: once is enough)
            for link in links:
                mesh.reserve(link, plan.room)
            plan.reserved = True
        h1, h2 = plan.makers[TWO_SCATTER](call.seq), plan.makers[TWO_GATHER](call.seq)
        x, out, rows, kind, op = call.flat, call.out, call.rows, call.kind, call.op
        assert kind is not None  # (plan.native: the C fold takes the call)
        code, sent, read, phase = mesh.two_hop(
            links, x, out, rows, plan.order, plan.edges, self.rank, h1, h2, kind, op, hot, wait
        )
        self._stopped(call, code, sent, read, phase)
        return code

    def _stopped(self, call: _Call, code: int, sent: Any, read: Any, phase: int) -> None:
        """The call's books after its first native call (TcpMesh.two_hop) returned: done, or the messages
        of the phase it stopped in, as far as they went (for the general way on from there)."""
        if code == 0 and phase == 2:
            call.phase, call.messages, call.left = TWO_GATHER, [], []  # done: nothing left for the loop
            return
        if phase == 1:
            self._start(call)
        else:
            self._gather(call)
        for m, went, got in zip(list(call.messages), sent, read, strict=True):
            m[3] = went
            if went == len(m[1]) + len(m[2]):
                call.messages.remove(m)
            if got:
                call.left.remove(m[0])

    def _drive(self, call: _Call, wait: float, hot: int) -> int:
        """Send and read this phase's messages in C (TcpMesh.scatter) for up to ``wait`` seconds, folding
        and going on to the second phase when the first is in (in the same native call where the C fold
        takes the call); 0 when the call is done, else the code that stopped it (1: time; 2: another
        message; 3: a link ended)."""
        mesh = self.net.small.tcp
        assert mesh is not None
        end = time.monotonic() + max(wait, 0.0)
        while True:
            code = self._round(call, mesh, hot, max(end - time.monotonic(), 0.0))
            if code != 0 or call.phase == TWO_GATHER:
                return code
            self._fold(call)
            self._gather(call)

    def _lists(self, call: _Call, mesh: TcpMesh) -> tuple[list[Any], ...]:
        """This phase's TcpMesh.scatter lists, a link for every peer in peer_order (empty, None: done)."""
        me, item = self.rank, call.flat.itemsize
        sending = {m[0]: m for m in call.messages}
        header = call.makers[call.phase](call.seq)
        sheads: list[Any] = []
        sends: list[Any] = []
        rheads: list[Any] = []
        dests: list[Any] = []
        heads: dict[int, bytes] = {}
        for p in self.ctx.peer_order:
            m = sending.get(p)
            if m is None:
                sheads.append(b"")
                sends.append(b"")
            elif m[3] == 0:
                sheads.append(m[1])
                sends.append(m[2])
            else:
                head, sent = m[1], m[3]
                sheads.append(head[sent:])
                sends.append(m[2][max(0, sent - len(head)) :])
            if p in call.left:
                a, b = call.bounds[me] if call.phase == TWO_SCATTER else call.bounds[p]
                dests.append(byte_view(call.rows[p] if call.phase == TWO_SCATTER else call.out[a:b]))
                size = (b - a) * item
                head = heads.get(size)
                if head is None:
                    head = heads[size] = mesh.head(header, size)
                rheads.append(head)
            else:
                dests.append(None)
                rheads.append(b"")
        return sheads, sends, rheads, dests

    def _round(self, call: _Call, mesh: TcpMesh, hot: int, wait: float) -> int:
        """One native call over every peer's link (the second phase too, in the same call, where the C fold
        takes the call); the books kept."""
        me = self.rank
        sheads, sends, rheads, dests = self._lists(call, mesh)
        then: tuple[Any, ...] | None = None
        if call.phase == TWO_SCATTER and call.kind is not None and _fold_chunk is not None:
            first = call.messages, call.left
            a, b = call.bounds[me]
            self._gather(call)
            then = (call.rows, me, call.out[a:b], call.kind, call.op, call.flat[a:b], *self._lists(call, mesh))
            call.phase = TWO_SCATTER
            second, (call.messages, call.left) = (call.messages, call.left), first
        links, members = mesh.links, self.members
        on = [links[members[p]] for p in self.ctx.peer_order]
        if any(link.closed for link in on):  # (its socket is gone: the loop names the loss)
            return 3
        code, sent, read, phase = mesh.scatter(on, sheads, sends, rheads, dests, hot, wait, then)
        if phase == 2:  # the first phase went whole, and the fold: the results are the second's
            call.phase, (call.messages, call.left) = TWO_GATHER, second
        sending = {m[0]: m for m in call.messages}
        for p, went, got in zip(self.ctx.peer_order, sent, read, strict=True):
            m = sending.get(p)
            if m is not None:
                m[3] += went
                if m[3] == len(m[1]) + len(m[2]):
                    call.messages.remove(m)
            if got:
                call.left.remove(p)
        return code

    def _fold(self, call: _Call) -> None:
        """This rank's chunk of every rank's tensor, folded in the canonical order into the result."""
        me = self.rank
        a, b = call.bounds[me]
        if call.kind is not None and _fold_chunk is not None and b > a:
            _fold_chunk(call.rows, me, call.out[a:b], call.kind, call.op, call.flat[a:b])
        else:
            call.rows[me] = call.flat[a:b]
            canonical_fold(call.rows, call.op, call.out[a:b], offset=a, total=call.flat.size)

    def _gather(self, call: _Call) -> None:
        """The second phase's messages: this rank's folded chunk to every rank."""
        mesh = self.net.small.tcp
        assert mesh is not None
        a, b = call.bounds[self.rank]
        call.phase = TWO_GATHER
        head = mesh.head(call.makers[TWO_GATHER](call.seq), (b - a) * call.flat.itemsize)
        payload = byte_view(call.out[a:b])
        call.left = list(self.ctx.peer_order)
        call.messages = [[p, head, payload, 0] for p in self.ctx.peer_order]

    def _queue(self, call: _Call, mesh: TcpMesh) -> None:
        """What the C calls did not send of this phase's messages, queued on the links for the loop."""
        for p, head, payload, sent in call.messages:
            link = mesh.links[self.members[p]]
            if not link.closed:
                mesh.queue_rest(link, memoryview(b"".join((head, payload)))[sent:])
        call.messages = []
        if mesh.backlog:
            mesh.flush()
