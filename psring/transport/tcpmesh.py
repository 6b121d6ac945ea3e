"""TCP links for small messages between the ranks of a job on several hosts: one raw socket per pair.

The ring's one-hop paths (a small all_reduce, a barrier) exchange one message per peer. Between
hosts they went through the connection layer (a protocol object, a frame header map, the
transport's buffers) on the event loop, and a blocking caller paid two thread hops on top: about
10x MPICH's time for a 4-byte all_reduce over TCP. Here each pair of ranks holds one more TCP
connection, authenticated like any other (psring.transport.handshake) and then taken out of the
event loop (:meth:`Connection.detach`), and a message is a 4-byte length and one
:func:`psring.core.wire.encode_message` -- the same messages the same-host Unix links carry
(psring.transport.unixmesh), and the same interface, so the ring's one-hop code drives either.

Unlike the Unix links, nobody reads these sockets when nobody waits on them: the event loop reads
them only while one of its collectives waits for a message (:meth:`TcpMesh.hold` /
:meth:`TcpMesh.release`), so that a blocking caller with nothing else in flight can send and read
them itself, on its own thread, with no hop to the loop and back (:meth:`send_now`, :meth:`fill`,
:meth:`peek`, :meth:`wait`). Bytes one reader took and did not use stay in the link's buffer for the
next. This module knows messages and peers, not collectives.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
import struct
from collections.abc import Callable
from typing import Any

from ..core import wire
from ..errors import PeerLostError, ProtocolError
from .mesh import Mesh, MeshLink

try:  # the C extension's read loop (psring/native/tcpmesh.c, a leaf: it imports nothing of psring)
    from .._native import tcp_exchange as _native_exchange
    from .._native import tcp_read as _native_read
    from .._native import tcp_scatter as _native_scatter
    from .._native import tcp_two_hop as _native_two_hop
except ImportError:  # not built here: the pure-Python loop (the caller's)
    _native_read = _native_exchange = _native_scatter = _native_two_hop = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

#: the largest payload a link carries: the one-hop paths send at most 64 KiB, the two-hop all_reduce a
#: ring chunk of up to a MiB (and a dtype's few bytes over: ring.paths.TWO_HOP_CHUNK_MAX)
MAX_PAYLOAD = (1 << 20) + 64
#: the largest message (its header, at most a few hundred bytes, and its payload)
MAX_MESSAGE = MAX_PAYLOAD + (64 << 10)

_LEN = struct.Struct("<I")
_READ = 256 << 10
#: a link's buffer to begin with: room for a read and a one-hop message; it grows for a larger message
_FIRST_BUF = _READ + (256 << 10) + _LEN.size


def _length(size: int) -> bytes:
    """A message's 4-byte length, for a message a link may carry."""
    if size > MAX_MESSAGE:
        raise ProtocolError(f"a {size}-byte message is over the small-message limit of {MAX_MESSAGE} bytes")
    return _LEN.pack(size)


class TcpLink(MeshLink):
    """One TCP socket to one peer rank (``pending``: the bytes the kernel did not take, in order), and
    what was read from it and not used yet."""

    __slots__ = ("buf", "end", "error", "fd", "start")

    def __init__(self, peer: int, sock: socket.socket) -> None:
        super().__init__(peer, sock)
        self.fd = sock.fileno()
        self.buf = bytearray(_FIRST_BUF)
        self.start = 0  #: buf[start:end] was read and not used yet
        self.end = 0
        self.error: BaseException | None = None  #: why it ended, once it did (None: an orderly end, or open)


class TcpMesh(Mesh[TcpLink]):
    """This rank's TCP small-message links to every other rank of the job.

    ``on_message(peer, head, payload)`` runs on the event loop for every message read there, in the
    order each peer sent them (``payload`` is a view valid during the call); ``on_closed(peer,
    error)`` once per link that ends while the mesh is open. Any thread may send and read while the
    loop does not hold the mesh (see the module's docstring); the loop sends with :meth:`send`.
    """

    #: a waiting rank sleeps in the loop (or ``poll``): with more ranks than cores a spinning one takes
    #: the core its peers need (docs/defaults.md#the-callers-thread-over-tcp).
    #: (The caller's-thread path gives its core up a few times before it sleeps: ring.tcpdirect.YIELDS.)
    spins = False

    def __init__(
        self,
        rank: int,
        peers: int,
        on_message: Callable[[int, tuple[Any, ...], memoryview], None],
        on_closed: Callable[[int, BaseException | None], None],
        native: bool = True,
    ) -> None:
        super().__init__(rank, on_message, on_closed)
        #: whether :meth:`read` reads in C (psring._native, where it was built, and ``native`` on)
        self.native = native and _native_read is not None
        self.expected = peers  #: the links to come (add)
        self.all_in = asyncio.Event()
        self.holds = 0  #: the loop's waiters: while there are any, the loop reads every link

    def add(self, peer: int, sock: socket.socket) -> None:
        """Keep a detached, authenticated socket as the link to ``peer``."""
        if peer in self.links:
            sock.close()
            raise ProtocolError(f"rank {peer} opened a second small-message link to rank {self.rank}")
        sock.setblocking(False)
        self.links[peer] = TcpLink(peer, sock)
        if len(self.links) >= self.expected:
            self.all_in.set()

    # ---------------------------------------------------------------- sending
    def send(self, peer: int, msg: bytes) -> None:
        """From the event loop: queue one message to ``peer`` (at once, when the kernel takes it)."""
        link = self.links[peer]
        if link.closed:
            raise PeerLostError(f"the TCP small-message link from rank {self.rank} to rank {peer} is closed", rank=peer)
        if not self._push(link, _length(len(msg)), msg):  # the length and the message, not joined (no copy)
            self._want_writer(link)

    @staticmethod
    def framed(header: bytes, payload: memoryview | None = None) -> bytes:
        """A message as a link carries it -- its length, the header (:func:`psring.core.wire.message_header`),
        the payload -- joined once: for :meth:`send_now` to several peers. Every rank's message for the
        same call begins with the same bytes, which :meth:`take` compares."""
        if payload is None:
            return _length(len(header)) + header
        return b"".join((_length(len(header) + payload.nbytes), header, payload))

    @staticmethod
    def head(header: bytes, nbytes: int) -> bytes:
        """A :meth:`framed` message's bytes before its ``nbytes`` of payload (what :meth:`take` compares)."""
        return _length(len(header) + nbytes) + header

    def usable(self, links: list[TcpLink]) -> bool:
        """Whether a thread may send on these links now: open, nothing queued (:meth:`exchange`)."""
        return not self.backlog and not any(link.closed or link.pending for link in links)

    def send_now(self, peer: int, frame: bytes) -> bool:
        """From a thread, the loop not holding the mesh: send one :meth:`framed` message; False if the
        kernel did not take it all (the rest is queued: the loop must :meth:`flush` it) or the link is
        closed."""
        link = self.links[peer]
        if link.closed:
            return False
        return self._push(link, frame)

    def take(self, link: TcpLink, head: bytes, size: int) -> memoryview | None:
        """The payload of the next message read from ``link`` if it begins with the bytes ``head`` (a
        :meth:`framed` message's first bytes: its length, header) and carries ``size`` bytes after
        them, used up; None if no whole message is there yet or it is another one (left for
        :meth:`peek`): the common case without decoding a header."""
        at, end = link.start, link.start + len(head) + size
        if link.end < end or link.buf[at : at + len(head)] != head:
            return None
        link.start = end
        return memoryview(link.buf)[end - size : end]

    def _push(self, link: TcpLink, *parts: bytes | memoryview) -> bool:
        """Send one framed message given in ``parts`` (one ``sendmsg``); False if the kernel did not take
        it all (the rest queued, in order) or the link failed (its ``error`` says why)."""
        if link.pending:
            self.queue_rest(link, b"".join(parts))
            return False
        try:
            n = link.sock.send(parts[0]) if len(parts) == 1 else link.sock.sendmsg(parts)  # send: less set-up
        except BlockingIOError:
            n = 0
        except OSError as exc:
            link.error = exc
            return False
        link.bytes_sent += n
        if n == sum(map(len, parts)):
            link.frames_sent += 1
            return True
        self.queue_rest(link, memoryview(b"".join(parts))[n:])  # the rare partial send: the rest, in order
        return False

    def flush(self) -> None:
        """From the event loop: send what threads left queued, as the kernel takes it."""
        for link in self.links.values():
            if link.pending and not link.closed:
                self._want_writer(link)

    def _want_writer(self, link: TcpLink) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        if link.error is not None:
            self._ended(link, link.error)
            return
        if link.pending:
            loop.add_writer(link.fd, self._writable, link)

    def _writable(self, link: TcpLink) -> None:
        while link.pending:
            data = link.pending[0]
            try:
                n = link.sock.send(data)
            except BlockingIOError:
                return
            except OSError as exc:
                self._ended(link, exc)
                return
            link.bytes_sent += n
            if n < len(data):
                link.pending[0] = data[n:]
                return
            link.pending.popleft()
            link.frames_sent += 1
        asyncio.get_running_loop().remove_writer(link.fd)
        self.backlog -= 1
        self._wake_drain()

    # -------------------------------------------------------------- receiving
    def fill(self, link: TcpLink) -> int:
        """Read what the kernel has for ``link`` without blocking: the bytes read, 0 if none came,
        -1 if the link ended (its ``error`` says why; None: the peer closed it)."""
        if link.closed:
            return -1
        buf = link.buf
        if link.start == link.end:
            link.start = link.end = 0
        elif len(buf) - link.end < _READ:  # move what is left to the front
            left = link.end - link.start
            buf[:left] = buf[link.start : link.end]
            link.start, link.end = 0, left
        try:
            n = link.sock.recv_into(memoryview(buf)[link.end :])
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            link.error = exc
            return -1
        if n == 0:
            return -1
        link.end += n
        link.bytes_received += n
        return n

    def peek(self, link: TcpLink) -> tuple[tuple[Any, ...], memoryview] | None:
        """The next whole message read from ``link`` (not used up: :meth:`consume`), or None."""
        have = link.end - link.start
        if have < _LEN.size:
            return None
        (size,) = _LEN.unpack_from(link.buf, link.start)
        if size > MAX_MESSAGE:
            raise ProtocolError(f"rank {link.peer} sent a {size}-byte message, over the {MAX_MESSAGE}-byte limit")
        if have < _LEN.size + size:
            self.reserve(link, _LEN.size + size)  # (a message larger than the buffer: it grows, once)
            return None
        at = link.start + _LEN.size
        return wire.decode_message(memoryview(link.buf)[at : at + size])

    @staticmethod
    def reserve(link: TcpLink, nbytes: int) -> None:
        """Make ``link``'s buffer hold a read and a message of ``nbytes`` (a length, a header, a payload)
        after what it holds now: a two-hop chunk is larger than the buffer a link begins with."""
        need = _READ + nbytes
        if len(link.buf) >= need:
            return
        buf = bytearray(need)
        left = link.end - link.start
        buf[:left] = link.buf[link.start : link.end]
        link.buf, link.start, link.end = buf, 0, left

    def consume(self, link: TcpLink) -> None:
        (size,) = _LEN.unpack_from(link.buf, link.start)
        link.start += _LEN.size + size

    def read(
        self,
        links: list[TcpLink],
        ranks: list[int],
        head: bytes,
        out: Any,
        yields: int,
        spin: float,
        timeout: float,
    ) -> int:
        """From a thread, the loop not holding the mesh, where :attr:`native`: read each of ``links``
        until its next message, which should begin with the bytes ``head`` (:meth:`take`), and put its
        payload in row ``ranks[i]`` of ``out`` (a C-contiguous array, a row each rank, rows the
        payload's size); the links and ranks read are taken out of both lists. The whole loop of
        :meth:`take`, :meth:`fill` and :meth:`wait` in C with the GIL released, the links' buffers left
        as those would leave them: the core given up ``yields`` times at most while ``spin`` seconds
        last, then asleep in ``poll``, back within ``timeout`` seconds. Returns 0: every message read;
        1: the time passed; 2: a link's next message is another one (left there, for :meth:`peek`); 3:
        a link ended (its ``error`` says why, as after :meth:`fill`)."""
        assert _native_read is not None
        if any(link.closed for link in links):
            return 3
        size = out.nbytes // len(out) if len(out) else 0
        return _native_read(links, ranks, head, size, out, yields, spin, timeout)

    def exchange(
        self,
        links: list[TcpLink],
        ranks: list[int],
        head: bytes,
        x: Any,
        bufs: Any,
        me: int,
        out: Any,
        kind: str,
        op: str,
        yields: int,
        spin: float,
        timeout: float,
    ) -> int:
        """From a thread, the loop not holding the mesh, where :attr:`native`: a whole one-hop exchange
        in one C call -- send the message ``head`` + ``x`` to each of ``links`` (a link to every other
        rank, in the order given), put ``x`` in row ``me`` of ``bufs``, read each peer's message into
        row ``ranks[i]`` as :meth:`read` does, and fold the rows into ``out`` in the canonical flat
        order (psring.core.fold.canonical_fold; ``kind``: psring.transport.shmboard.fold_kind's letter).
        Returns 0: done; 1, 2, 3: as :meth:`read` (every message sent; the links not read are left in
        the lists for the caller). A message the kernel did not take whole is queued as :meth:`send_now`
        queues it, the rest are sent the same way, and the code is 4: nothing was read (the lists
        untouched) -- the loop must :meth:`flush`. The links must be open (:meth:`usable`)."""
        assert _native_exchange is not None
        code, bad, sent = _native_exchange(links, ranks, head, x, bufs, me, out, kind, op, yields, spin, timeout)
        if code != 4:
            return code
        frame = memoryview(b"".join((head, x.data)))
        link = links[bad]
        if sent < 0:
            link.error = OSError(-sent, os.strerror(-sent))
        else:
            self.queue_rest(link, frame[sent:])  # as _push leaves a partial send: the rest, in order
        for link in links[bad + 1 :]:
            self._push(link, frame)
        return 4

    def scatter(
        self,
        links: list[TcpLink],
        sheads: list[bytes],
        sends: list[Any],
        rheads: list[bytes],
        dests: list[Any],
        hot: int,
        timeout: float,
        then: tuple[Any, ...] | None = None,
    ) -> tuple[int, tuple[int, ...], tuple[bool, ...], int]:
        """From a thread (or the loop, briefly), the loop not holding the mesh, where :attr:`native`: send
        each of ``links`` its own message, ``sheads[i]`` + ``sends[i]`` (empty: nothing), and read from it
        a message that begins with the bytes ``rheads[i]`` (:meth:`head`), its payload straight into
        ``dests[i]`` (writable, the payload's size; None: read nothing), all at once and without
        blocking, in C with the GIL released: with nothing to do the core given up ``hot`` times (counted
        again after each move), then asleep in ``poll``, back within ``timeout`` seconds. ``then``: a second
        phase, (rows, first, out, kind, op, own, sheads, sends, rheads, dests): once every message of the
        first is sent and read, ``rows`` folded in the canonical order of a ring chunk that begins at rank
        ``first`` (row ``first`` read from ``own``) into ``out``, and the second phase's messages as the
        first's. Returns (code, the bytes of each link's message that went, whether each link's message
        was read, the phase those are of: 1 or 2); codes as :meth:`read` (3: a link ended; its ``error``
        says why). A message half read is left in its link's buffer as :meth:`fill` would have left it; one
        half sent must be queued (:meth:`queue_rest`) before anything else goes on that link. The links
        must be open (:meth:`usable`)."""
        assert _native_scatter is not None
        for link, head, dest in zip(links, rheads, dests, strict=True):
            if dest is not None:
                self.reserve(link, len(head) + len(dest))
        if then is not None:
            for link, head, dest in zip(links, then[8], then[9], strict=True):
                if dest is not None:
                    self.reserve(link, len(head) + len(dest))
        return _native_scatter(links, sheads, sends, rheads, dests, hot, timeout, then)

    @staticmethod
    def two_hop(
        links: list[TcpLink],
        x: Any,
        out: Any,
        rows: Any,
        order: bytes,
        bounds: bytes,
        first: int,
        h1: bytes,
        h2: bytes,
        kind: str,
        op: str,
        hot: int,
        timeout: float,
    ) -> tuple[int, tuple[int, ...], tuple[bool, ...], int]:
        """:meth:`scatter` of a two-hop all_reduce's two phases, its messages made in C from the call
        rather than listed (the lists cost more than the rest of the call's Python): link i goes to rank
        ``order[i]`` (int64 bytes), whose chunk of the flat tensor ``x`` is the bytes ``bounds[2 r]`` to
        ``bounds[2 r + 1]`` (int64 bytes, every rank's); this rank is ``first``. The first phase sends each
        rank its chunk of ``x`` (header ``h1``) and reads its copy of this rank's chunk into row
        ``order[i]`` of ``rows``; ``rows`` is folded into ``out``'s chunk; the second phase sends that
        (header ``h2``) to every rank and reads each rank's folded chunk into place in ``out``. The same
        messages, result and books as :meth:`scatter` with ``then``. Each link's buffer must have room
        for a read and the largest message it receives (:meth:`reserve`)."""
        assert _native_two_hop is not None
        return _native_two_hop(links, x, out, rows, order, bounds, first, h1, h2, kind, op, hot, timeout)

    def queue_rest(self, link: TcpLink, message: bytes | memoryview) -> None:
        """Queue what was not sent of one message on ``link`` (in order, after anything queued there; a
        link with something queued counts once in ``backlog``): the loop sends it (:meth:`flush`)."""
        if not link.pending:
            self.backlog += 1
        link.pending.append(memoryview(message))
        link.deferred += 1

    def wait(self, links: list[TcpLink], timeout: float) -> bool:
        """Block this thread until one of ``links`` has bytes to read (or ended); False on timeout."""
        poller = select.poll()
        for link in links:
            poller.register(link.fd, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout * 1000))))

    # ---------------------------------------------------- the event loop's reading
    def hold(self) -> None:
        """A collective on the loop waits for messages: read every link there (until release)."""
        self.holds += 1
        if self.holds > 1:
            return
        loop = asyncio.get_running_loop()
        self._loop = loop
        for link in list(self.links.values()):
            if not link.closed:
                loop.add_reader(link.fd, self._readable, link)
        for link in list(self.links.values()):  # what a thread read and left: the loop's now
            if not link.closed and link.end > link.start:
                self._deliver(link)

    def release(self) -> None:
        self.holds -= 1
        if self.holds or self._loop is None:
            return
        for link in self.links.values():
            if not link.closed:
                self._loop.remove_reader(link.fd)

    def _readable(self, link: TcpLink) -> None:
        n = self.fill(link)
        if n < 0:
            self._deliver(link)
            self._ended(link, link.error)
            return
        if n:
            self._deliver(link)

    def catch_up(self, peer: int) -> None:
        link = self.links.get(peer)
        while link is not None and self.holds and not link.closed:  # (not held: a thread may be reading it)
            n = self.fill(link)
            if n == 0:
                return
            self._deliver(link)
            if n < 0:  # its end, after what came before it
                self._ended(link, link.error)

    def _deliver(self, link: TcpLink) -> None:
        """Hand every whole message read from ``link`` to on_message (while the loop holds the mesh)."""
        try:
            while not link.closed and self.holds:
                got = self.peek(link)
                if got is None:
                    return
                head, payload = got
                self.consume(link)
                self.on_message(link.peer, head, payload)
        except ProtocolError as exc:
            self._ended(link, ProtocolError(f"rank {link.peer} sent a bad small-message frame: {exc}"))
