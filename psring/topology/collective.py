"""One in-flight collective on one rank (its call descriptor, deadline and outcome),
and how mismatched calls are described."""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Callable
from typing import Any

import msgpack

from ..errors import PsringError
from ..transport import traffic
from ..transport.connection import Connection

logger = logging.getLogger(__name__)


class Collective:
    """One in-flight collective on one rank: its descriptor, deadline and outcome."""

    __slots__ = (
        "bulk_mark",
        "data_elsewhere",
        "deadline",
        "desc",
        "done",
        "group",
        "input_wait",
        "interrupted",
        "kind",
        "owed",
        "report_grace",
        "seq",
        "stalled",
        "started",
        "task",
        "timer",
        "waiting_on",
    )

    def __init__(
        self, group: Any, seq: int, desc: tuple[Any, ...], timeout: float, started: float | None = None
    ) -> None:
        self.group = group
        self.seq = seq
        self.desc = desc
        self.kind = desc[0]
        self.started = time.monotonic() if started is None else started
        self.deadline = self.started + timeout
        self.timer: asyncio.TimerHandle | None = None  # the next stall check, or the deadline
        self.stalled = 0  # stall thresholds passed so far (the inspector ran that often)
        #: the process's bulk bytes received when it began or was last inspected (transport.traffic): a
        #: call that waits while bulk moves is a slow transfer, not a stall
        self.bulk_mark = traffic.received()
        self.done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting_on: set[int] = set()  # ranks we still expect frames from
        self.owed: dict[int, int] = {}  # frames still due, by sender, where a path counts them (expect_from)
        #: its data comes over links other than the control connections (the ring's data plane),
        #: so a peer's goodbye does not prove that all of the peer's data has arrived
        self.data_elsewhere = False
        #: seconds to wait after the deadline before reporting: another rank knows better who is silent
        self.report_grace = 0.0
        self.task: asyncio.Task[Any] | None = None  # the task running the body
        self.interrupted = False
        #: set when the input is still being copied off a device: wait(a, b) blocks until
        #: elements a:b are in host memory (see Group._input_order)
        self.input_wait: Callable[[int, int], None] | None = None

    @property
    def label(self) -> str:
        return f"{self.kind} #{self.seq}"

    def expect_from(self, src: int, frames: int = 1) -> None:
        """``frames`` more frames are due from rank ``src``: it is in ``waiting_on`` until all are in."""
        if frames:
            self.owed[src] = self.owed.get(src, 0) + frames
            self.waiting_on.add(src)

    def arrived_from(self, src: int) -> None:
        """A frame due from rank ``src`` came: once all of them are in, src's leaving costs this call nothing
        (a peer that finished and left is no reason to fail a call that has everything it owed)."""
        left = self.owed[src] - 1
        self.owed[src] = left
        if not left:
            self.waiting_on.discard(src)

    def fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)
            task = self.task
            if task is not None and not self.interrupted:
                self.interrupted = True
                task.cancel()  # Group.run turns this back into exc

    def inspect(self, conn: Connection, header: dict[str, Any]) -> bool:
        """Check a frame of this collective against our own call; False drops it."""
        call = header.get("call")
        if call == self.desc or self.done.done():
            return not self.done.done()
        src = header.get("src", conn.peer.get("rank"))
        err = self.group.mismatch_error(self, src, call)
        self.group.abort_everywhere(self, err, "mismatch")
        return False


_FIELDS = ("kind", "dtype", "shape", "op", "root", "after")

#: calls a rank can return from having heard from only some of the ranks (a broadcast's root sends and
#: returns; a scatter's receiver hears from the root alone): a mismatch in one of them may be found by
#: other ranks after this rank has returned, so the next call's descriptor names it (``after``)
PARTIAL = frozenset({"broadcast", "scatter", "gather", "reduce"})


def after_of(desc: tuple[Any, ...]) -> int | None:
    """The ``after`` field of the call that follows ``desc`` on a group: a digest of desc when it is a
    call of :data:`PARTIAL` kind, else None.

    Why: ranks 0 and 1 call ``scatter(src=0)`` while rank 2 calls ``reduce(dst=0)``. Rank 1 hears from
    rank 0 alone and returns a right-looking result; ranks 0 and 2 find the mismatch only when each reads
    the other's frame, maybe after all three have sent their next call's data -- and rank 1 would return
    from that call too. With the digest in every frame of the next call (rank 2's names its reduce, rank
    1's its scatter), rank 1 names the mismatch in that next call, whichever way the frames race. The
    digest is a CRC-32 of the packed descriptor, without its own ``after``: stable across processes, and a
    few bytes in a board's tag. A partial call that raised on this rank before the next began names nothing
    (runtime._failed): where every rank raised, the next call goes on as ever."""
    if desc[0] not in PARTIAL:
        return None
    return zlib.crc32(msgpack.packb(desc[:5]))


def mismatch_message(seq: int, src: Any, call: Any, rank: Any, desc: tuple[Any, ...]) -> str:
    """Say how rank src's call descriptor for collective #seq differs from rank's own."""
    if not isinstance(call, (list, tuple)) or len(call) != len(_FIELDS):
        return f"rank {src} sent a frame for #{seq} without a valid call descriptor"
    theirs = dict(zip(_FIELDS, call, strict=True))
    mine = dict(zip(_FIELDS, desc, strict=True))
    if theirs["kind"] != mine["kind"]:
        return (
            f"rank {src} called {describe(call)} #{seq}, rank {rank} called {describe(desc)} #{seq}: "
            "every rank must make the same calls, with the same arguments, in the same order"
        )
    diffs = [f for f in _FIELDS[1:] if theirs[f] != mine[f]]
    field = diffs[0] if diffs else "call"
    if field == "after":
        return (
            f"rank {src} called {describe(call)} #{seq} after another call #{seq - 1} than rank {rank} made "
            f"there: collective #{seq - 1} was mismatched (rank {src} and rank {rank} made different calls, "
            "or the same call with other arguments); every rank must make the same calls, with the same "
            "arguments, in the same order"
        )
    if field in ("op", "root"):
        fix = "pass the same op on every rank" if field == "op" else "pass the same src/dst on every rank"
        return f"rank {src} called {describe(call)} #{seq}, rank {rank} called {describe(desc)} #{seq}: {fix}"
    fix = {
        "dtype": "cast to one dtype on every rank",
        "shape": "pass arrays of one shape on every rank",
    }.get(field, "")
    return (
        f"rank {src} sent {field} {_show(theirs.get(field))} for {mine['kind']} #{seq}, "
        f"rank {rank} expected {_show(mine.get(field))}" + (f" ({fix})" if fix else "")
    )


def describe(desc: Any, detail: bool = False) -> str:
    """A call as a user wrote it: ``all_reduce(sum)``, ``broadcast(src=0)``, ``reduce(sum, dst=0)``;
    with ``detail``, the array too (``all_reduce(sum, float32[10])``)."""
    if not isinstance(desc, (list, tuple)) or len(desc) not in (5, 6):  # (5: the call alone, without after)
        return repr(desc)
    kind, dtype, shape, op, root = desc[:5]
    args = [str(op)] if op is not None else []
    if root is not None:
        args.append(f"{'src' if kind in ('broadcast', 'scatter') else 'dst'}={root}")
    if detail and dtype is not None:
        args.append(f"{dtype}{list(shape) if shape is not None else ''}")
    return f"{kind}({', '.join(args)})" if args else str(kind)


def _failure(coll: Collective) -> BaseException:
    exc = coll.done.exception() if coll.done.done() and not coll.done.cancelled() else None
    return exc or PsringError(f"{coll.label} was abandoned")


async def _absorb_cancel(task: asyncio.Task[Any] | None) -> None:
    """Consume a cancellation requested for this task that no await has delivered yet."""
    try:
        await asyncio.sleep(0)
    except asyncio.CancelledError:
        if task is not None:
            task.uncancel()


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return str(list(value))
    return str(value)
