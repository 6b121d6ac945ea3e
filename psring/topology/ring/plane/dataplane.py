"""The ring's data plane: all_reduce bytes on two blocking sockets, driven by two threads.

Control stays on asyncio (handshakes, heartbeats, aborts, every other collective);
the bytes of ``all_reduce`` do not. docs/performance-history.md has why: on loopback 80-86% of
the time is the kernel copying, and one event-loop thread that receives, adds and
sends in turn leaves that copying idle half the time. Here a send thread and a
receive thread (which also does the reduction) each block in their own syscalls,
which, like numpy, release the GIL, so sending, receiving and adding overlap.

Each rank dials one data link to its right neighbour (authenticated like any
connection, then taken out of the event loop) and accepts one from its left. A
rank sends on the first and receives on the second, so each socket has one
thread. Collectives go through a FIFO of jobs in the order the ranks called them
(the same on every rank); every frame names its collective, so frames of a job one
rank abandoned (after a mismatch, a timeout) are skipped by the next one.

Frame: a 24-byte header (magic, index in the job's stream, seq, nbytes) and the
payload. Index 0 of every job is the call descriptor (msgpack), compared with the
receiver's own: ranks that called different things get a ``MismatchError``, not
misread bytes. The order of the other frames follows from the ring algorithm, so
a frame out of place is a protocol error.

When both neighbours are on one host (the ring agreed on same-host links), a link's
payloads go through shared memory instead: the left rank's own pool
(:class:`psring.transport.shmpool.ShmPool`, an anonymous memfd the right rank maps read-only, so
nothing is named anywhere and nothing is left behind when a process dies), ``slots`` buffers of a
piece each, written by the left rank, read in place by the right one.
Only the header crosses the socket (its magic is ``SHM_MAGIC`` with the slot's number
in the low byte), and the receiver hands a slot back by writing its number, one byte,
the other way on the same socket. The right rank folds straight out of the slot into
its result or, for a partial sum it only hands on, into a free slot of its own link to
the right, so a piece costs one copy into a slot, or none, and one pass of the fold,
instead of the kernel copying it twice through loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import socket
import threading
from collections.abc import Callable

import msgpack
import numpy as np

from ....core.arrays import byte_view
from ....transport import traffic
from ....transport.shmpool import PeerPool, ShmPool
from .job import (
    _FINAL,
    _REDUCE,
    _STORE,
    _STORE_FWD,
    HEADER,
    MAGIC,
    MAX_CALL,
    POLL,
    SHM_MAGIC,
    Job,
    PlaneLinkError,
    PlaneMismatch,
    Turns,
    _Abandoned,
    ring_steps,
)
from .native import Here, NativeJobs, available
from .rightlink import RightLink

logger = logging.getLogger(__name__)


class _Reader:
    """Buffered frame reader on the receiving socket; survives abandoned jobs mid-frame."""

    def __init__(self, sock: socket.socket, shm: ShmPool | PeerPool | None = None) -> None:
        self.sock = sock
        self.buf = bytearray(1 << 16)
        self.view = memoryview(self.buf)
        self.start = self.end = 0
        self.skip = 0  # payload bytes of an abandoned frame still to drop
        self.bytes_received = 0
        self.credits_sent = 0  # bytes written back: one per slot handed back
        self.shm = shm
        self.in_slot = False  # the current frame's payload is in a shared-memory slot: this one
        self.slot = 0

    def _recv(self, dest: memoryview, job: Job) -> int:
        while True:
            try:
                n = self.sock.recv_into(dest)
            except TimeoutError:
                if job.gone():
                    raise _Abandoned from None
                continue
            if n == 0:
                raise PlaneLinkError("the left neighbour closed its data link", "recv")
            self.bytes_received += n
            traffic.note(n)
            return n

    def _fill(self, job: Job) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif len(self.buf) - self.end < HEADER.size:
            n = self.end - self.start
            self.view[:n] = self.view[self.start : self.end]
            self.start, self.end = 0, n
        self.end += self._recv(self.view[self.end :], job)

    def _drop(self, job: Job) -> None:
        while self.skip:
            if self.start == self.end:
                self._fill(job)
            take = min(self.skip, self.end - self.start)
            self.start += take
            self.skip -= take

    def header(self, job: Job) -> tuple[int, int, int]:
        """(index, seq, nbytes) of the next frame, skipping frames of earlier collectives."""
        while True:
            self._drop(job)
            while self.end - self.start < HEADER.size:
                self._fill(job)
            magic, index, seq, nbytes = HEADER.unpack_from(self.buf, self.start)
            if magic & ~0xFF == SHM_MAGIC and self.shm is not None:
                self.in_slot, self.slot = True, magic & 0xFF
                if self.slot >= self.shm.slots or nbytes > self.shm.slot_bytes:
                    raise PlaneLinkError(f"the data link from the left named slot {self.slot} ({nbytes} bytes)", "recv")
            elif magic == MAGIC:
                self.in_slot = False
            else:
                raise PlaneLinkError(f"the data link from the left sent a bad frame (magic {magic:#x})", "recv")
            if seq >= job.seq:
                return index, seq, nbytes
            self.start += HEADER.size  # a frame of a collective this rank abandoned
            if self.in_slot:
                self.release(nbytes)
            else:
                self.skip = nbytes

    def take_slot(self, nbytes: int) -> np.ndarray:
        """Consume the current header; its payload, in place in the shared segment (read-only).
        Hand it back with ``release`` once read."""
        assert self.shm is not None and self.in_slot
        self.start += HEADER.size
        return self.shm.view(self.slot, nbytes)

    def release(self, nbytes: int) -> None:
        """The current slot is read: the left neighbour may write it again."""
        self.bytes_received += nbytes
        traffic.note(nbytes)
        try:
            self.sock.sendall(bytes((self.slot,)))
            self.credits_sent += 1
        except OSError:
            pass  # the left neighbour sent all it had and left: it needs no slot back

    def payload(self, job: Job, dest: memoryview) -> None:
        """Consume the current header and read its payload into dest."""
        self.start += HEADER.size
        n = len(dest)
        have = min(self.end - self.start, n)
        dest[:have] = self.view[self.start : self.start + have]
        self.start += have
        off = have
        while off < n:
            try:
                off += self._recv(dest[off:], job)
            except _Abandoned:
                self.skip = n - off
                raise


class DataPlane:
    """Two data links (to the right, from the left), a thread on each, and a FIFO of jobs."""

    def __init__(
        self, rank: int, world_size: int, native: bool = True, send_thread: int = 0, send_thread_buf: int = 0
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.stop = threading.Event()
        #: jobs' tickets: a job's frames go out after those of the job before it
        self.turns = Turns(self.stop)
        #: the link to the right (its socket, its shared-memory slots) and the send thread's work
        self.right = RightLink(self.turns, self.stop)
        #: jobs over TCP that run in C, on one thread (psring._native.NRing: jobs whose dtype and op its fold
        #: takes, neither link in shared memory, no device staging); None where not built or not wanted
        self.native = (
            NativeJobs(rank, world_size, self.turns, self.right, send_thread, send_thread_buf)
            if native and available()
            else None
        )
        self.recv_sock: socket.socket | None = None
        self.recv_ready: asyncio.Event | None = None
        self._recv_q: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._reader: _Reader | None = None
        self.closed = False
        #: the shared-memory segment of the link from the left (same-host neighbours), see ``use_shm``
        self.shm_in: ShmPool | PeerPool | None = None
        self.slots_filled_here = 0  # pieces the receive thread folded straight into a slot to the right

    @property
    def bytes_received(self) -> int:
        """Bytes from the left (frames on the socket, payloads in its shared slots), and the
        slot hand-backs from the right (one byte each)."""
        return (self._reader.bytes_received if self._reader is not None else 0) + self.right.slots_back

    @property
    def bytes_sent(self) -> int:
        """Bytes to the right (frames on the socket, payloads in its shared slots), and the
        slot hand-backs to the left."""
        return self.right.bytes_sent + (self._reader.credits_sent if self._reader is not None else 0)

    @property
    def send_sock(self) -> socket.socket | None:
        return self.right.sock

    @property
    def shm_out(self) -> ShmPool | PeerPool | None:
        """The shared-memory segment of the link to the right (same-host neighbours), see ``use_shm``."""
        return self.right.shm

    @shm_out.setter
    def shm_out(self, pool: ShmPool | PeerPool | None) -> None:
        self.right.shm = pool

    @property
    def ready(self) -> bool:
        return bool(self._threads) and not self.closed

    def set_recv(self, sock: socket.socket) -> None:
        self.recv_sock = sock
        sock.settimeout(POLL)
        if self.recv_ready is not None:
            self.recv_ready.set()

    def set_send(self, sock: socket.socket) -> None:
        self.right.sock = sock
        sock.settimeout(None)

    def use_shm(self, out: ShmPool | None, into: PeerPool | None) -> None:
        """Payloads to the right go through ``out``, those from the left come in ``into``
        (either may be None: that link carries its payloads on the socket). Before ``start``."""
        self.right.use(out)
        self.shm_in = into
        if self.native is not None:
            self.native.shm_links = out is not None or into is not None

    def start(self) -> None:
        assert self.send_sock is not None and self.recv_sock is not None
        self._reader = _Reader(self.recv_sock, self.shm_in)
        if self.native is not None:
            self.native.reader = self._reader
        for target, name in ((self.right.run, "send"), (self._recv_loop, "recv")):
            t = threading.Thread(target=target, name=f"psring-rank{self.rank}-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    # ----------------------------------------------------------------- jobs
    def all_reduce(
        self,
        seq: int,
        call: bytes,
        x: np.ndarray,
        parts: list[list[tuple[int, int]]],
        ufunc: np.ufunc,
        avg: bool,
        on_error: Callable[[BaseException], None],
        ready: Callable[[int, int], None] | None = None,
        op: str = "",
        here: Here | None = None,
    ) -> Job:
        """Queue a pipelined ring reduce-scatter + all-gather of flat x; ``parts[c]`` are the
        pieces (element ranges) of ring chunk c. The job's ``out`` holds the result once
        ``done``, folded in the canonical order. ``ready(a, b)``, if given, is called (in the
        plane's threads) before x[a:b] is read: x may still be arriving from a device.
        ``op`` (ufunc's name, "avg" for avg): where the native ring folds it (:attr:`native`), the
        receive thread sends and receives every frame of the job in C, with no hand-off to the send
        thread -- the same frames, so a native rank and a threaded one share a ring. ``here``: a job
        the caller's thread began (NativeJobs.run_here): the receive thread carries it on where it
        stands."""
        n, me = self.world_size, self.rank
        steps = ring_steps(parts, me, n)
        n_own = len(parts[me])
        n_fwd = sum(1 for s in steps if s[2] != _STORE)
        avg_n = n if avg else 0
        job = Job(seq, call, x, steps, 1 + n_own + n_fwd, 1 + n_own, ufunc, avg_n, on_error, self.stop, ready)
        native = self.native
        if here is not None:
            job.native, job.ticket, job.out = here
        else:
            job.ticket = self.turns.take()
            kind = native.kind(x, op) if native is not None and ready is None else None
            if native is not None and kind is not None:
                # the receive thread alone, in C: no frame goes through the send thread
                job.native = native.ring(seq, call, x, job.out, steps, parts[me], kind, op, avg)
        if job.native is not None:
            assert native is not None  # (a job in C is one of its)
            job.one_thread()
            native.jobs += 1
            self._recv_q.put(job)
            return job
        job.queued = 1 + len(parts[me])  # (before any thread sees the job)
        job.fwd.put((HEADER.pack(MAGIC, 0, seq, len(call)) + call, None, None))
        for j, (a, b) in enumerate(parts[me]):
            data = byte_view(x[a:b])
            self.right.own_frame(job, HEADER.pack(MAGIC, 1 + j, seq, data.nbytes), data, (a, b))
        # own frames are queued before the receive thread can forward anything: stream order
        self.right.queue.put(job)
        self._recv_q.put(job)
        return job

    def idle(self) -> bool:
        """Whether every job queued so far ended on both threads (a caller's thread may run one:
        NativeJobs.run_here)."""
        return self.ready and self.turns.idle()

    # -------------------------------------------------------------- threads
    # Each job is handled in a method of its own, so that no local keeps its arrays (the
    # caller's input, the result) alive once it is done: a result the caller drops goes
    # back to the pool at once.
    def _recv_loop(self) -> None:
        reader = self._reader
        assert reader is not None
        while True:
            job = self._recv_q.get()
            if job is None:
                return
            if not self._recv_job(job, reader):
                return
            del job

    def _recv_job(self, job: Job, reader: _Reader) -> bool:
        """Receive (and reduce, and hand on) one job's frames; False when the plane is closing."""
        if job.gone() and job.native is None:
            self.turns.received(job.ticket)
            return True
        try:
            try:
                if job.native is not None:
                    assert self.native is not None
                    self.native.receive(job, reader, self.stop)
                else:
                    self._receive(job, reader)
            finally:  # before the caller hears of it: its next call finds the plane idle (run_here)
                self.turns.received(job.ticket)
        except _Abandoned:
            return True
        except PlaneMismatch as exc:
            job.fail(exc)
            return True
        except PlaneLinkError as exc:
            if self.closed:
                return False
            job.fail(exc)
            return True
        except OSError as exc:
            if self.closed:
                return False
            job.fail(PlaneLinkError(f"receiving from the left neighbour failed: {exc}", "recv"))
            return True
        except Exception as exc:  # pragma: no cover - a bug: surface it on the collective
            logger.exception("data plane receive failed")
            job.fail(exc)
            return True
        job.part_done()
        return True

    def _receive(self, job: Job, reader: _Reader) -> None:
        seq = job.seq
        index, _, nbytes = self._next(job, reader)
        if index != 0 or nbytes > MAX_CALL:
            raise PlaneLinkError(f"collective #{seq}: the left neighbour's first frame is #{index}", "recv")
        call = bytearray(nbytes)
        reader.payload(job, memoryview(call))
        if bytes(call) != job.call:
            try:
                theirs = msgpack.unpackb(bytes(call), use_list=False)
            except Exception:  # a peer's bytes: only for the message
                theirs = None
            raise PlaneMismatch(theirs)
        x, out, ufunc = job.x, job.out, job.ufunc
        expect = 1
        for a, b, what in job.steps:
            index, _, nbytes = self._next(job, reader)
            dest = out[a:b]
            view = byte_view(dest)
            if index != expect or nbytes != view.nbytes:
                raise PlaneLinkError(
                    f"collective #{seq}: frame #{index} of {nbytes} bytes from the left neighbour, "
                    f"expected #{expect} of {view.nbytes}",
                    "recv",
                )
            expect += 1
            if reader.in_slot:  # fold (or copy) straight out of the shared slot
                src = reader.take_slot(nbytes).view(dest.dtype)
                k = self.right.take_slot(nbytes) if what in (_REDUCE, _STORE_FWD) else None
                if what <= _FINAL:
                    if job.ready is not None:
                        job.ready(a, b)
                    if k is not None:  # a partial sum only handed on: straight into the next slot
                        assert self.right.shm is not None
                        ufunc(src, x[a:b], out=self.right.shm.view(k, nbytes).view(dest.dtype))
                    else:
                        ufunc(src, x[a:b], out=dest)  # canonical: (fold so far) op own
                    if what == _FINAL and job.avg:
                        np.divide(dest, dest.dtype.type(job.avg), out=dest)
                else:
                    np.copyto(dest, src)
                    if k is not None:  # handed on too: from the slot just read, still in cache
                        assert self.right.shm is not None
                        np.copyto(self.right.shm.view(k, nbytes).view(dest.dtype), src)
                del src
                reader.release(nbytes)
                if k is not None:
                    self.slots_filled_here += 1
                    self.right.forward_slot(job, k, nbytes)
                elif what != _STORE:
                    self.right.forward(job, view)
                continue
            reader.payload(job, view)
            if what <= _FINAL:
                if job.ready is not None:
                    job.ready(a, b)
                ufunc(dest, x[a:b], out=dest)  # canonical: (fold so far) op own
                if what == _FINAL and job.avg:
                    np.divide(dest, dest.dtype.type(job.avg), out=dest)
            if what != _STORE:
                self.right.forward(job, view)

    @staticmethod
    def _next(job: Job, reader: _Reader) -> tuple[int, int, int]:
        while True:
            index, at, nbytes = reader.header(job)
            if at == job.seq:
                return index, at, nbytes
            # the left neighbour is already past this collective: it abandoned it, and
            # the control plane will fail ours too; wait for that without reading on
            if job.cancelled.wait(POLL) or job.stop.is_set():
                raise _Abandoned

    # ---------------------------------------------------------------- close
    def close(self) -> None:
        """Stop the threads and close both links (idempotent; never blocks for long)."""
        if self.closed:
            return
        self.closed = self.right.closed = True
        self.stop.set()
        for sock in (self.send_sock, self.recv_sock):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        self.right.queue.put(None)
        self._recv_q.put(None)
        for t in self._threads:
            t.join(timeout=2.0)
        for sock in (self.send_sock, self.recv_sock):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        stuck = any(t.is_alive() for t in self._threads)
        if not stuck:  # a thread that may still touch a mapping keeps it (nothing is named: nothing leaks)
            for segment in (self.shm_out, self.shm_in):
                if segment is not None:
                    segment.close()
