"""The data plane's jobs in C: one thread sends and receives every frame of a job over TCP
(psring._native.NRing, psring/native/ring.c), with the frames the two Python threads would send, so a
rank that runs its jobs here and one that does not share a ring.

A :class:`NativeJobs` belongs to a plane (plane.dataplane) built where the C extension is: the plane's
receive thread runs the jobs queued to it (:meth:`NativeJobs.receive`), and a caller's thread runs a
job of its own while the plane is idle (:meth:`NativeJobs.begin_here`, :meth:`NativeJobs.run_here`:
the blocking API, and the loop within its spin). How a rank runs one -- yielding its core a while on
one thread, or with a send thread of its own and the link's send buffer bounded -- is the rank's own
choice (:meth:`NativeJobs.engine`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from typing import Any, Protocol

import msgpack
import numpy as np

from ....transport import traffic
from ....transport.shmboard import fold_kind
from ....transport.tcpsocket import set_send_buffer
from .job import POLL, Job, PlaneLinkError, PlaneMismatch, Turns, _Abandoned, ring_steps
from .rightlink import RightLink

try:  # the C extension's one-thread ring (psring/native/ring.c, a leaf: it imports nothing of psring)
    from ...._native import NRing as _NRing
except ImportError:  # not built here: the plane's two threads
    _NRing = None  # type: ignore[assignment,misc]

#: NRing.run's codes (psring/native/ring.c)
_RING_DONE, _RING_WAIT, _RING_MISMATCH, _RING_AHEAD, _RING_BAD, _RING_RECV_ERR, _RING_SEND_ERR = range(7)
#: a native job with nothing to do gives its core up this many times before it sleeps in poll: with more
#: ranks than cores the neighbour it waits for runs sooner
NATIVE_HOT = 64
#: seconds an abandoned native job waits to send the rest of a frame it began (then the link is shut)
NATIVE_FINISH = 5.0

#: (the NRing, its ticket among the plane's jobs, the result) of a job a caller's thread began
Here = tuple[Any, int, np.ndarray]


class FrameSource(Protocol):
    """The plane's reader of the link from the left (plane.dataplane._Reader): NRing reads through it,
    so bytes it buffered ahead belong to the next job whoever runs it."""

    sock: socket.socket
    bytes_received: int


def available() -> bool:
    """Whether the C extension's ring is built here."""
    return _NRing is not None


class NativeJobs:
    """The plane's jobs that run in C: which do (:meth:`kind`), how (:meth:`engine`), on the plane's
    receive thread (:meth:`receive`) or a caller's (:meth:`begin_here`, :meth:`run_here`)."""

    def __init__(
        self, rank: int, world_size: int, turns: Turns, right: RightLink, send_thread: int = 0, send_thread_buf: int = 0
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.turns = turns
        self.right = right
        #: jobs from this many bytes send from a thread of their own (0: never; see engine)
        self.send_thread = send_thread
        #: the send buffer of the link to the right while a send thread runs (0: as the kernel sizes it; buffers)
        self.send_thread_buf = send_thread_buf
        self._buffer_size = 0  # what buffers last set (0: nothing, or the largest)
        self.send_thread_runs = 0  # runs (a job's one or more) that sent from a thread of their own
        self.jobs = 0  # jobs run in C, on the receive thread or a caller's
        #: a link in shared memory (same-host neighbours): there the two threads were faster
        #: (docs/defaults.md#the-planes-job-in-c), so no job runs here
        self.shm_links = False
        self.reader: FrameSource | None = None  # the plane's reader, once it started

    def kind(self, x: np.ndarray, op: str) -> str | None:
        """The native fold's letter where a job of x and op runs in C (an aligned contiguous numpy
        array of a dtype and op the fold takes, neither link in shared memory), else None."""
        if self.shm_links or type(x) is not np.ndarray or not x.flags.c_contiguous or not x.flags.aligned:
            return None
        return fold_kind(x.dtype, op)

    def ring(
        self,
        seq: int,
        call: bytes,
        x: np.ndarray,
        out: np.ndarray,
        steps: list[tuple[int, int, int]],
        own: list[tuple[int, int]],
        kind: str,
        op: str,
        avg: bool,
    ) -> Any:
        """A job over the plane's two sockets: ``steps`` as job.ring_steps makes them, ``own`` this rank's
        own pieces, the result into ``out``."""
        assert self.right.sock is not None and self.reader is not None
        avg_n = self.world_size if avg else 0
        send, recv = self.right.sock.fileno(), self.reader.sock.fileno()
        return _NRing(send, recv, seq, call, x, out, steps, own, kind, op, avg_n)

    # ---------------------------------------------------------------- on a caller's thread
    def begin_here(
        self,
        seq: int,
        call: bytes,
        x: np.ndarray,
        out: np.ndarray,
        parts: list[list[tuple[int, int]]],
        kind: str,
        op: str,
        avg: bool,
    ) -> Here:
        """On the caller's thread, the plane idle: a job of its own, numbered among the plane's jobs;
        run it with :meth:`run_here`."""
        steps = ring_steps(parts, self.rank, self.world_size)
        return self.ring(seq, call, x, out, steps, parts[self.rank], kind, op, avg), self.turns.take(), out

    def run_here(self, here: Here, wait: float) -> bool:
        """Run a job :meth:`begin_here` began, on the caller's thread, until it is done (True) or nothing
        moved for ``wait`` seconds or something is out of the ordinary (False: hand it to
        DataPlane.all_reduce, whose receive thread carries it on from where it stands and names what
        went wrong). The plane's threads are idle meanwhile: the job's turn is theirs to wait for."""
        ring, ticket, out = here
        try:
            hot, helper = self.engine(out.nbytes)
            reader = self.reader
            before = reader.bytes_received if reader is not None else 0
            with traffic.transfer():  # (its bytes are counted when it returns: a heartbeat knows it runs)
                code = ring.run(reader, hot, wait, helper)
            if reader is not None:
                traffic.note(reader.bytes_received - before)
        except BaseException:
            self.turns.over(ticket)  # (run raises only setting up or writing back: the job goes no further)
            raise
        if code != _RING_DONE:
            return False
        self.right.bytes_sent_here += ring.sent
        self.jobs += 1
        self.turns.over(ticket)
        return True

    # ---------------------------------------------------------------- on the receive thread
    def receive(self, job: Job, reader: FrameSource, stop: threading.Event) -> None:
        """One job's every frame, sent and received in C on this thread, after the frames of the jobs
        before it; its frames all out (or the link shut) before the next job's."""
        ring = job.native
        try:
            if not self.turns.wait(job) or job.gone():
                raise _Abandoned
            hot, helper = self.engine(job.x.nbytes)
            moved = True
            while True:
                before = reader.bytes_received
                # a run counts its bytes when it returns (at the end, or after POLL without one): while it
                # runs, bulk counts as moving, unless its last run saw nothing (a heartbeat and the stall
                # inspector tell a slow transfer from a silent peer by it)
                with traffic.transfer() if moved else contextlib.nullcontext():
                    code = ring.run(reader, hot, POLL, helper)
                got = reader.bytes_received - before
                traffic.note(got)
                moved = got > 0
                if code == _RING_DONE:
                    return
                if code == _RING_WAIT:
                    if job.gone():
                        raise _Abandoned
                elif code == _RING_AHEAD:  # the left neighbour abandoned it: wait for ours to be failed
                    if job.cancelled.wait(POLL) or stop.is_set():
                        raise _Abandoned
                else:
                    raise _failure(code, ring)
        finally:
            sock = self.right.sock
            if not self.right.closed and not ring.finish(NATIVE_FINISH) and sock is not None:
                # a frame left half sent: no whole frame can follow it, so the right neighbour sees the end
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
            self.right.bytes_sent_here += ring.sent
            job.native = None  # (its buffers: the input and the result)
            self.turns.done(job)

    # ---------------------------------------------------------------- how
    def engine(self, nbytes: int) -> tuple[int, bool]:
        """How this rank runs a job of ``nbytes``: (how often it yields the core before it sleeps,
        whether its frames to the right go out from a thread of their own). The frames are the same
        either way, so each rank decides alone. From :attr:`send_thread` bytes the calling thread
        receives and folds while a second sends, each sleeping in the kernel at once when it has
        nothing to do: on a busy machine that holds its share of the cores (docs/performance-history.md,
        "Where the cores go, fourth look"); below it, one thread does both and yields a while first."""
        if 0 < self.send_thread <= nbytes:
            self.send_thread_runs += 1
            self.buffers(self.send_thread_buf)
            return 0, True
        self.buffers(0)
        return NATIVE_HOT, False

    def buffers(self, size: int) -> None:
        """The send buffer (SO_SNDBUF) of the link to the right for the next job: ``size`` bytes for a job
        with a send thread -- a few pieces in flight, not the megabytes the kernel grows it to, which two
        threads outran (docs/defaults.md#the-planes-send-thread) -- and back to the largest the kernel allows
        for a job on one thread (0). Left alone where no job ever asks for a size. The receive buffer is
        never set: shrunk under a window its peer was already given, the kernel drops what no longer fits
        and the sender waits out a retransmission timeout -- 16 MiB jobs between 8 MiB ones at 4 ranks took
        230 ms, not 26, when both ends were bounded."""
        if size == self._buffer_size or self.right.sock is None:
            return
        set_send_buffer(self.right.sock, size)
        self._buffer_size = size


def _failure(code: int, ring: Any) -> Exception:
    """What a run's code other than done, wait and ahead means, as the plane's errors."""
    if code == _RING_MISMATCH:
        try:
            theirs = msgpack.unpackb(ring.theirs, use_list=False)
        except Exception:  # a peer's bytes: only for the message
            theirs = None
        return PlaneMismatch(theirs)
    if code == _RING_BAD:
        return PlaneLinkError(ring.why, "recv")
    if code == _RING_RECV_ERR:
        why = os.strerror(ring.err) if ring.err else ""
        return PlaneLinkError(
            f"receiving from the left neighbour failed: {why}" if why else "the left neighbour closed its data link",
            "recv",
        )
    why = os.strerror(ring.err) if ring.err else ""
    return PlaneLinkError(
        f"sending to the right neighbour failed: {why}" if why else "the right neighbour closed its data link", "send"
    )
