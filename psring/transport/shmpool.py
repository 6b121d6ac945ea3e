"""Shared-memory payload pools for connections between processes on one host.

A process that sends large payloads to peers on its own host (a parameter-server
worker pushing pieces, a server process sending folded results) keeps one *pool*: an
anonymous memory file (``memfd``) of ``slots`` equal slots after one header page. A
peer on the same host maps it read-only through ``/proc/<pid>/fd/<fd>`` -- nothing is
ever named in a file system, so nothing is left behind when a process dies -- and checks
a random 16-byte token the owner wrote at its start. A frame whose payload sits in a
slot then carries only the slot's number on the socket; the receiver reads the payload
from its mapping and hands the slot back (see :class:`psring.transport.connection.Connection`).

A slot is reference counted: the owner holds it while writing, and every frame that
lends it to a peer holds it until that peer hands it back. One slot may be lent to
many peers at once (a result every worker reads), so the payload is written once.
Slots lent to a peer whose connection was *lost* (not closed) are quarantined until
that peer's process is gone: it may still be reading them, and reusing them early
could hand it -- or, through it, others -- another payload's bytes.

Only the pool's owner writes to it; peers map it read-only. Who may map it is the
kernel's rule for ``/proc/<pid>/fd``: processes of the same user (as for ptrace).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import mmap
import os
import secrets
import stat
from typing import Any

import numpy as np

from .samehost import host_key

PAGE = mmap.PAGESIZE
TOKEN_BYTES = 16
MAX_SLOTS = 4096
MAX_SLOT_BYTES = 1 << 30
#: the most a peer's pool may map here
MAX_PEER_POOL = 1 << 36


class ShmPool:
    """A process's own pool: it writes payloads into slots and lends them to peers."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"a shared-memory pool has 1 to {MAX_SLOTS} slots, not {slots}")
        if not 1 <= slot_bytes <= MAX_SLOT_BYTES:
            raise ValueError(f"a shared-memory slot has 1 to {MAX_SLOT_BYTES} bytes, not {slot_bytes}")
        self.slots = slots
        self.slot_bytes = -(-slot_bytes // PAGE) * PAGE  # page-aligned slots: any dtype view is aligned
        size = PAGE + slots * self.slot_bytes
        self.fd = os.memfd_create("psring-pool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            # reserve the pages now: memory that is not there fails here, not with SIGBUS later
            os.posix_fallocate(self.fd, 0, size)
            # mapped by need (no MAP_POPULATE): a page enters this process's page tables when first
            # touched, so a process that uses a little of a large pool holds a little. That is what
            # a kill costs its peers: the kernel tears down a dying process's mappings before it
            # closes its sockets, some 5 ms per 100 MiB mapped here, all of it before they see EOF.
            self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.mm[:TOKEN_BYTES] = self.token
        self.array = np.frombuffer(self.mm, np.uint8)
        self.free: collections.deque[int] = collections.deque(range(slots))
        self.refs = [0] * slots
        self.closed = False
        self.quarantined: list[tuple[int | None, dict[int, int]]] = []  # (peer pid, slot -> count)
        self.owners: list[tuple[Any, int] | None] = [None] * slots  # what each slot in use was taken for
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def describe(self) -> dict[str, Any]:
        """What a peer needs to map this pool (sent in a ``pool`` frame)."""
        return {
            "pid": os.getpid(),
            "fd": self.fd,
            "slots": self.slots,
            "slot_bytes": self.slot_bytes,
            "token": self.token,
            "host": host_key(),
        }

    def take(self, owner: tuple[Any, int] | None = None) -> int | None:
        """A free slot, held once by the caller (give it back when done lending it), or None.

        ``owner`` -- (stream, order), e.g. (group id, collective number) -- says what the
        slot holds, for :meth:`may_wait`."""
        if not self.free and self.quarantined:
            self.sweep()
        if not self.free or self.closed:
            return None
        k = self.free.popleft()
        self.refs[k] = 1
        self.owners[k] = owner
        return k

    def may_wait(self, stream: Any, order: int) -> bool:
        """Whether waiting for a slot cannot deadlock: every slot in use holds a piece of the
        same stream, at most this far along it. Such pieces are folded (and their slots handed
        back) once every peer has pushed them, and each peer pushes a stream in order; a slot
        held by anything else may wait on this very caller, which then sends on the socket."""
        if self.closed or self.quarantined:  # quarantined slots may stay out for as long as a peer lives
            return False
        return all(
            owner is not None and owner[0] == stream and owner[1] <= order
            for k, owner in enumerate(self.owners)
            if self.refs[k]
        )

    async def wait_free(self) -> None:
        """Until a slot is given back (it may be taken by someone else before the caller runs)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(fut)

    def lend(self, k: int) -> None:
        self.refs[k] += 1

    def give_back(self, k: int) -> None:
        self.refs[k] -= 1
        if self.refs[k] == 0:
            self.owners[k] = None
            self.free.appendleft(k)  # the next taken: a pool reuses the few slots it needs (mapped, in cache)
            while self._waiters:
                fut = self._waiters.popleft()
                if not fut.done():
                    fut.set_result(None)
                    break

    def quarantine(self, lent: dict[int, int], pid: int | None) -> None:
        """Slots lent to a peer that was lost: back to the pool once process ``pid`` is gone
        (never, if it is not known)."""
        if lent:
            self.quarantined.append((pid, dict(lent)))
            self.sweep()

    def sweep(self) -> None:
        """Give back the quarantined slots of peers whose processes have ended."""
        kept = []
        for pid, lent in self.quarantined:
            if pid is not None and not _alive(pid):
                for k, count in lent.items():
                    for _ in range(count):
                        self.give_back(k)
            else:
                kept.append((pid, lent))
        self.quarantined = kept

    @property
    def in_use(self) -> int:
        return self.slots - len(self.free)

    def view(self, k: int, nbytes: int) -> np.ndarray:
        start = PAGE + k * self.slot_bytes
        return self.array[start : start + nbytes]

    def close(self) -> None:
        """Unmap and close; peers that mapped it keep their mappings until they let go."""
        if self.closed:
            return
        self.closed = True
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self.array = np.empty(0, np.uint8)
        with contextlib.suppress(BufferError):  # a view still held somewhere: the mapping goes with it
            self.mm.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process now has that number: ours is gone
        return False
    return True


class PeerPool:
    """A read-only mapping of a peer's pool."""

    def __init__(self, mm: mmap.mmap, slots: int, slot_bytes: int) -> None:
        self.mm = mm
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.array = np.frombuffer(mm, np.uint8)

    @classmethod
    def open(cls, desc: Any) -> PeerPool:
        """Map the pool a peer described (ValueError for a malformed or foreign one, OSError)."""
        if not isinstance(desc, dict):
            raise ValueError(f"a pool description is a map, not {type(desc).__name__}")
        pid, fd, slots, slot_bytes = desc.get("pid"), desc.get("fd"), desc.get("slots"), desc.get("slot_bytes")
        token, host = desc.get("token"), desc.get("host")
        if not (
            type(pid) is int
            and pid > 0
            and type(fd) is int
            and fd >= 0
            and type(slots) is int
            and 1 <= slots <= MAX_SLOTS
            and type(slot_bytes) is int
            and 1 <= slot_bytes <= MAX_SLOT_BYTES
            and slot_bytes % PAGE == 0
            and isinstance(token, bytes)
            and len(token) == TOKEN_BYTES
        ):
            raise ValueError(f"malformed pool description {desc!r:.200}")
        if host is None or host != host_key():
            raise ValueError("the pool is on another host (or another network or pid namespace)")
        size = PAGE + slots * slot_bytes
        if size > MAX_PEER_POOL:
            raise ValueError(f"a pool of {slots} x {slot_bytes} bytes is larger than {MAX_PEER_POOL} bytes")
        handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(handle)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise ValueError(f"/proc/{pid}/fd/{fd} is not a pool of {slots} x {slot_bytes} bytes")
            if st.st_blocks * 512 < size:  # mapping holes would make this process pay for them
                raise ValueError(f"/proc/{pid}/fd/{fd} has pages not reserved by its owner")
            mm = mmap.mmap(handle, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)  # by need, as the owner's
        finally:
            os.close(handle)
        if mm[:TOKEN_BYTES] != token:
            mm.close()
            raise ValueError(f"/proc/{pid}/fd/{fd} is not the pool described (its token differs)")
        return cls(mm, slots, slot_bytes)

    def view(self, k: int, nbytes: int) -> np.ndarray:
        start = PAGE + k * self.slot_bytes
        return self.array[start : start + nbytes]

    def close(self) -> None:
        self.array = np.empty(0, np.uint8)
        with contextlib.suppress(BufferError):
            self.mm.close()


__all__ = ["PeerPool", "ShmPool"]
