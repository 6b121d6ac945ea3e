"""What the data plane's two threads share: the frame format, a job (one all_reduce on the plane), and
the jobs' turns (a job's frames go out after those of the job before it, on every rank in one order).

Frame: a 24-byte header (magic, index in the job's stream, seq, nbytes) and the payload; plane.dataplane's
docstring has the protocol, plane.rightlink the send side.
"""

from __future__ import annotations

import asyncio
import queue
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ....core.arrays import result_empty

MAGIC = 0x31445350  # b"PSD1"
SHM_MAGIC = 0x31485300  # b"\0SH1" + slot number in the low byte: the payload is in that slot
SHM_MAX_SLOTS = 256
HEADER = struct.Struct("<IIQQ")  # magic, index, seq, nbytes
POLL = 0.1  # how often a blocked thread looks whether its job was abandoned
SMALL_SEND = 64 << 10  # header and payload up to this size leave in one syscall
MAX_CALL = 4096  # bytes of a call descriptor

#: a receive step: (a, b, what) -- what: reduce and forward, reduce (final: the result) and
#: forward, store and forward, store only
_REDUCE, _FINAL, _STORE_FWD, _STORE = range(4)


def ring_steps(parts: list[list[tuple[int, int]]], rank: int, world_size: int) -> list[tuple[int, int, int]]:
    """The receive steps of a job, in order: (a, b, what) for every piece rank receives; ``parts[c]`` are
    the pieces (element ranges) of ring chunk c."""
    n, me = world_size, rank
    steps: list[tuple[int, int, int]] = []
    for k in range(1, n):  # reduce-scatter: chunks me-1, me-2, ..., me+1 (final here)
        c = (me - k) % n
        steps.extend((a, b, _REDUCE if k < n - 1 else _FINAL) for a, b in parts[c])
    for k in range(n - 1):  # all-gather: chunks me, me-1, ..., me+2 (not forwarded: it is done)
        c = (me - k) % n
        steps.extend((a, b, _STORE_FWD if k < n - 2 else _STORE) for a, b in parts[c])
    return steps


#: put in a job's queue when the receive thread sent its last frame itself: the send thread wakes and ends it
_ALL_OUT: tuple[bytes, None, None] = (b"", None, None)


class PlaneLinkError(Exception):
    """A data link failed (the peer went away, or sent bytes that are not frames)."""

    def __init__(self, message: str, side: str) -> None:
        super().__init__(message)
        self.side = side  # "send" (to the right) or "recv" (from the left)


class PlaneMismatch(Exception):
    """The left neighbour's frames are for another call than ours."""

    def __init__(self, call: Any) -> None:
        super().__init__(f"left neighbour called {call!r}")
        self.call = call


class _Abandoned(Exception):
    pass


class Job:
    """One all_reduce on the data plane: what to send, what to receive, and where."""

    def __init__(
        self,
        seq: int,
        call: bytes,
        x: np.ndarray,
        steps: list[tuple[int, int, int]],
        n_send: int,
        first_index: int,
        ufunc: np.ufunc,
        avg: int,
        on_error: Callable[[BaseException], None],
        stop: threading.Event,
        ready: Callable[[int, int], None] | None = None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.seq = seq
        self.call = call
        self.x = x
        self.out = result_empty(x)
        self.steps = steps
        self.n_send = n_send  # items the send thread sends, own ones included
        self.next_index = first_index  # stream index of the first forwarded frame
        self.ufunc = ufunc
        self.avg = avg  # divide the final chunks by this (op avg), 0: no
        self.on_error = on_error
        self.stop = stop  # the plane is closing
        self.ready = ready  # ready(a, b): block until x[a:b] holds the input (device staging)
        # (header, payload, input range to wait for before sending it, if any); a payload that
        # is an int: that many bytes are in the slot the header names already
        self.fwd: queue.SimpleQueue[tuple[bytes, memoryview | int | None, tuple[int, int] | None] | None] = (
            queue.SimpleQueue()
        )
        self.send_closed = False  # the send thread is done with it (under the plane's slot lock)
        # under the plane's slot lock: frames handed to the kernel whole (by the send thread, or by the
        # receive thread straight away: DataPlane._forward), and items in fwd the send thread has not
        # finished sending (while there are any, nothing may go out past them)
        self.out_count = 0
        self.queued = 0
        self.cancelled = threading.Event()
        self.done: asyncio.Future[None] = self.loop.create_future()
        self._pending = 2  # the send and the receive thread
        #: the job's place among the plane's jobs: its frames go out after those of the job before
        self.ticket = 0
        #: psring._native.NRing: the receive thread sends and receives every frame itself (set in all_reduce)
        self.native: Any = None
        self._lock = threading.Lock()

    def one_thread(self) -> None:
        """The job runs on one thread (the receive thread, in C): one part_done ends it."""
        self._pending = 1

    def cancel(self) -> None:
        self.cancelled.set()

    def gone(self) -> bool:
        return self.cancelled.is_set() or self.stop.is_set()

    def part_done(self) -> None:
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._tell(_resolve, self.done)

    def fail(self, exc: BaseException) -> None:
        self.cancelled.set()
        self.fwd.put(None)  # wake the send thread
        self._tell(self.on_error, exc)

    def _tell(self, fn: Callable[..., None], arg: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop is closed: nobody waits for this job any more
            pass


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Turns:
    """The plane's jobs in the order every rank queued them: a job's ticket, and the last job whose frames
    are all sent (or never will be) and the last the receive side is done with."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.issued = 0
        self.sent_upto = 0
        self.recv_upto = 0
        self._cond = threading.Condition()

    def take(self) -> int:
        """The next job's ticket (on the loop's thread or the caller's: one at a time)."""
        self.issued += 1
        return self.issued

    def idle(self) -> bool:
        """Whether every job with a ticket ended on both sides."""
        return self.sent_upto == self.issued and self.recv_upto == self.issued

    def wait(self, job: Job) -> bool:
        """Block until the jobs before ``job`` sent all their frames; False if the plane closed meanwhile."""
        with self._cond:
            while self.sent_upto < job.ticket - 1:
                if self.stop.is_set():
                    return False
                self._cond.wait(POLL)
        return True

    def done(self, job: Job) -> None:
        """Every frame of ``job`` is out (or never will be): the next job's turn."""
        with self._cond:
            self.sent_upto = max(self.sent_upto, job.ticket)
            self._cond.notify_all()

    def received(self, ticket: int) -> None:
        self.recv_upto = max(self.recv_upto, ticket)

    def over(self, ticket: int) -> None:
        """A job the caller's thread ran is over on both sides."""
        with self._cond:
            self.sent_upto = self.recv_upto = ticket
            self._cond.notify_all()
