"""The data plane's link to the right neighbour: its socket, its shared-memory slots (same-host
neighbours), and the send thread's work -- a job's own frames and those the receive thread hands on.

The receive thread (plane.dataplane) hands frames on through :meth:`RightLink.forward` (over TCP straight
into the socket when nothing of the job waits for the send thread) and :meth:`RightLink.forward_slot` (a
slot it folded into itself, :meth:`RightLink.take_slot`); the send thread (:meth:`RightLink.run`) sends
what is queued, in order, after the frames of the job before (:class:`plane.job.Turns`).
"""

from __future__ import annotations

import collections
import queue
import select
import socket
import threading

import numpy as np

from ....transport.shmpool import PeerPool, ShmPool
from .job import _ALL_OUT, HEADER, MAGIC, POLL, SHM_MAGIC, SMALL_SEND, Job, PlaneLinkError, Turns


class RightLink:
    """The link to the right neighbour and the send thread's loop (see the module's docstring)."""

    def __init__(self, turns: Turns, stop: threading.Event) -> None:
        self.turns = turns
        self.stop = stop
        self.sock: socket.socket | None = None
        #: the link's shared-memory pool (same-host neighbours; ``use``), else None: payloads on the socket
        self.shm: ShmPool | PeerPool | None = None
        self.queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.closed = False
        # free slots, and how many frames queued for the send thread still need one (the receive thread
        # fills a slot itself only if one is left over for each of those: see take_slot)
        self._free: collections.deque[int] = collections.deque()
        self._unslotted = 0
        self.lock = threading.Lock()
        self._slots_back = 0  # slots the right neighbour has handed back
        self.bytes_sent_thread = 0  # by the send thread
        self.bytes_sent_here = 0  # by the receive thread (forward, and its native jobs)
        #: frames the receive thread sent itself, whole or (``frames_split_here``) in part, the rest queued
        self.frames_sent_here = 0
        self.frames_split_here = 0
        self.shm_bytes_sent = 0

    @property
    def bytes_sent(self) -> int:
        """Bytes to the right: frames on the socket, payloads in its shared slots."""
        return self.bytes_sent_thread + self.bytes_sent_here

    @property
    def slots_back(self) -> int:
        return self._slots_back

    def use(self, shm: ShmPool | PeerPool | None) -> None:
        """Payloads go through ``shm`` (None: on the socket). Before the threads start."""
        self.shm = shm
        self._free = collections.deque(range(shm.slots) if shm is not None else ())

    def own_frame(self, job: Job, header: bytes, data: memoryview, needs: tuple[int, int]) -> None:
        """Queue one of the job's own pieces (before any thread sees the job)."""
        if self.needs_slot(data.nbytes):
            with self.lock:
                self._unslotted += 1
        job.fwd.put((header, data, needs))

    def run(self) -> None:
        while True:
            job = self.queue.get()
            if job is None or not self._job(job):
                return
            del job

    def _job(self, job: Job) -> bool:
        """Send one job's frames; False when the plane is closing."""
        try:
            return self._frames(job)
        finally:
            self._close(job)

    def _frames(self, job: Job) -> bool:
        sock = self.sock
        assert sock is not None
        if self.turns.sent_upto < job.ticket - 1 and not self.turns.wait(job):  # a native job's frames go first
            return False
        try:
            while True:
                with self.lock:
                    if job.out_count >= job.n_send:
                        break
                try:
                    item = job.fwd.get(timeout=POLL)
                except queue.Empty:
                    if job.gone():
                        return True
                    continue
                if item is None:
                    return True  # the receive side gave up on it
                if item is _ALL_OUT:
                    continue  # the receive thread sent the last frames itself
                header, payload, needs = item
                if needs is not None and job.ready is not None:
                    job.ready(*needs)
                if payload is None:
                    sock.sendall(header)
                    self.bytes_sent_thread += len(header)
                elif isinstance(payload, int):  # the receive thread filled the slot
                    sock.sendall(header)
                    self.bytes_sent_thread += len(header) + payload
                    self.shm_bytes_sent += payload
                elif self.needs_slot(payload.nbytes):
                    if not self._send_slot(job, header, payload):
                        return True
                elif payload.nbytes <= SMALL_SEND:
                    sock.sendall(header + payload)
                    self.bytes_sent_thread += len(header) + payload.nbytes
                else:
                    sock.sendall(header)
                    sock.sendall(payload)
                    self.bytes_sent_thread += len(header) + payload.nbytes
                with self.lock:
                    job.out_count += 1
                    job.queued -= 1
        except OSError as exc:
            if self.closed:
                return False
            self.turns.done(job)
            job.fail(PlaneLinkError(f"sending to the right neighbour failed: {exc}", "send"))
            return True
        self.turns.done(job)  # (again in _close_send) before the caller hears: its next call finds the plane idle
        job.part_done()
        return True

    def needs_slot(self, nbytes: int) -> bool:
        return self.shm is not None and nbytes <= self.shm.slot_bytes

    def _harvest(self) -> None:
        """Take the slots the right neighbour handed back (under the slot lock; never blocks)."""
        sock = self.sock
        assert sock is not None
        try:
            back = sock.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        if not back:
            raise ConnectionResetError("the right neighbour closed its data link")
        self._slots_back += len(back)
        self._free.extend(back)

    def _send_slot(self, job: Job, header: bytes, payload: memoryview) -> bool:
        """Copy a payload into a free slot and send its header; False if the job was abandoned
        while every slot was taken."""
        shm, sock = self.shm, self.sock
        assert shm is not None and sock is not None
        while True:
            with self.lock:
                if not self._free:
                    self._harvest()
                if self._free:
                    k = self._free.popleft()
                    self._unslotted -= 1
                    break
            ready, _, _ = select.select([sock], [], [], POLL)
            if not ready and job.gone():
                return False
        np.copyto(shm.view(k, payload.nbytes), np.frombuffer(payload, np.uint8))
        sock.sendall(HEADER.pack(SHM_MAGIC | k, *HEADER.unpack(header)[1:]))
        self.bytes_sent_thread += len(header) + payload.nbytes
        self.shm_bytes_sent += payload.nbytes
        return True

    def _close(self, job: Job) -> None:
        """The send thread is done with job: slots filled for frames it will not send are free
        again, and frames that would have needed one are no longer counted."""
        self.turns.done(job)
        with self.lock:
            job.send_closed = True
            while True:
                try:
                    item = job.fwd.get_nowait()
                except queue.Empty:
                    return
                if item is None or item[1] is None:
                    continue
                if isinstance(item[1], int):
                    self._free.append(item[0][0])  # the slot number: the header's first (low) byte
                elif self.needs_slot(item[1].nbytes):
                    self._unslotted -= 1

    def forward(self, job: Job, view: memoryview) -> None:
        """Hand a frame to the right neighbour (receive thread): over TCP, when nothing of the job waits
        for the send thread, straight into the socket as far as the kernel takes it without blocking
        (no wake-up of the send thread: on this VM a thread switch costs about as much CPU as moving
        100 KB); the rest, or a frame whose payload goes into a slot, is queued for the send thread."""
        header = HEADER.pack(MAGIC, job.next_index, job.seq, view.nbytes)
        job.next_index += 1
        payload: memoryview = view
        with self.lock:
            if job.send_closed:
                return
            if self.needs_slot(view.nbytes):
                self._unslotted += 1
            elif job.queued == 0:
                rest = self._send_now(header, view)
                if rest is None:
                    self.frames_sent_here += 1
                    job.out_count += 1
                    if job.out_count >= job.n_send:
                        job.fwd.put(_ALL_OUT)  # the send thread may be waiting for this job's next item
                    return
                header, payload = rest
                if len(header) + payload.nbytes < HEADER.size + view.nbytes:
                    self.frames_split_here += 1
            job.queued += 1
            job.fwd.put((header, payload, None))

    def _send_now(self, header: bytes, view: memoryview) -> tuple[bytes, memoryview] | None:
        """Send header and payload without blocking (under the slot lock, the send thread idle for the
        job); None when the kernel took it all, else what is left (any error: left for the send thread,
        which names it)."""
        sock = self.sock
        assert sock is not None
        try:
            n = sock.sendmsg([header, view], [], socket.MSG_DONTWAIT)
        except OSError:  # BlockingIOError: the buffer is full; anything else, the send thread says
            n = 0
        self.bytes_sent_here += n  # (a counter of this thread's own: += is no atomic step)
        if n == len(header) + view.nbytes:
            return None
        if n < len(header):
            return header[n:], view
        return b"", view[n - len(header) :]

    def take_slot(self, nbytes: int) -> int | None:
        """A free slot of the link to the right for the receive thread to fill, if one is left
        over once every frame queued for the send thread that needs one has one. (Else such a
        frame could wait forever for a slot held by a frame queued behind it. Those frames get
        their slots in queue order and slots only come back, so the margin holds.)"""
        if not self.needs_slot(nbytes):
            return None
        with self.lock:
            if len(self._free) <= self._unslotted:
                try:
                    self._harvest()
                except OSError:
                    return None  # the send thread will find the link broken and say so
            return self._free.popleft() if len(self._free) > self._unslotted else None

    def forward_slot(self, job: Job, k: int, nbytes: int) -> None:
        """Queue the header of slot k, which the receive thread filled."""
        header = HEADER.pack(SHM_MAGIC | k, job.next_index, job.seq, nbytes)
        job.next_index += 1
        with self.lock:
            if job.send_closed:
                self._free.append(k)
                return
            job.queued += 1
            job.fwd.put((header, nbytes, None))
