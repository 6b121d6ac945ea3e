"""Same-host links: Unix seqpacket sockets between the ranks of one host, for small messages.

When every rank of a job runs under one kernel, in one network and one pid namespace
(one machine, or containers sharing both), a small collective need not cross TCP:
a seqpacket socket keeps message boundaries, so a message is one ``send`` and one
``recv_into``, with no stream framing, no protocol object and no transport buffers
in between: several times faster than the TCP links for small messages (the runs:
docs/defaults.md#ring).

A message is one whole frame (:func:`psring.core.wire.encode_message`); this module
knows messages and peers, not collectives.

Trust: each rank binds a listening socket under a random abstract name and
publishes ``(host key, name, pid)`` through the store. A link is kept only if the
kernel's credentials of the other end (``SO_PEERCRED``) show the pid that rank
published, so a stranger on the host who finds the name cannot pose as a rank.
``PSRING_SAME_HOST=off`` keeps everything on TCP (and TLS, when configured).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import struct
from collections.abc import Callable
from typing import Any

import msgpack

from ..core import wire
from ..errors import CollectiveTimeoutError, PeerLostError, ProtocolError
from .mesh import Mesh, MeshLink
from .samehost import host_key

logger = logging.getLogger(__name__)

#: the largest message a link carries; a bigger one is refused at the sender. Fits the
#: default socket send buffer (~208 KiB), which a seqpacket message must fit whole
MAX_MESSAGE = 128 << 10

_CREDS = struct.Struct("3i")


def peer_pid(sock: socket.socket) -> int:
    pid, _uid, _gid = _CREDS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))
    return int(pid)


class UnixLink(MeshLink):
    """One seqpacket socket to one peer rank (``pending``: whole messages the kernel did not take)."""

    __slots__ = ()


class UnixMesh(Mesh[UnixLink]):
    """This rank's Unix links to the other ranks on its host.

    ``on_message(peer, head, payload)`` runs for every message, in the order each peer
    sent them; ``payload`` is a view into a receive buffer that is reused as soon as
    the callback returns (copy what you keep). ``on_closed(peer, error)`` runs once per
    link that ends while the mesh is open (``error`` None for an orderly end).
    """

    def __init__(
        self,
        rank: int,
        job: str,
        on_message: Callable[[int, tuple[Any, ...], memoryview], None],
        on_closed: Callable[[int, BaseException | None], None],
    ) -> None:
        super().__init__(rank, on_message, on_closed)
        self.job = job
        self.listener: socket.socket | None = None
        self.name = ""
        self._buf = bytearray(MAX_MESSAGE + 1)
        self._view = memoryview(self._buf)

    # ------------------------------------------------------------------ set-up
    def bind(self) -> dict[str, Any]:
        """Listen under a fresh abstract name; return what to publish for the peers."""
        key = host_key()
        if key is None:
            raise OSError("this system cannot tell which processes share its host (no /proc or SO_PEERCRED)")
        self.name = f"psring-{self.job[:40]}-{self.rank}-{secrets.token_hex(8)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind("\0" + self.name)
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self.listener = sock
        return {"key": key, "name": self.name, "pid": os.getpid()}

    async def connect(self, peers: dict[int, dict[str, Any]], timeout: float) -> None:
        """Link to every peer: dial the higher ranks, accept the lower ones (each checked by pid)."""
        assert self.listener is not None
        me, loop = self.rank, asyncio.get_running_loop()
        acceptor = _Acceptor(self.listener, me, self.job, {r: p for r, p in peers.items() if r < me}, timeout)
        accepting = asyncio.ensure_future(acceptor.run())
        dials = [asyncio.ensure_future(_dial(me, self.job, r, peers[r])) for r in sorted(peers) if r > me]
        try:
            async with asyncio.timeout(timeout):
                dialed = await asyncio.gather(*dials)
                await acceptor.all_in.wait()
        except TimeoutError:
            missing = sorted(set(acceptor.lower) - set(acceptor.accepted))
            raise CollectiveTimeoutError(
                f"rank {me}: rank(s) {missing} did not open their same-host links within {timeout:g}s "
                "(PSRING_SAME_HOST=off keeps every rank on TCP)",
                missing=tuple(missing),
            ) from None
        except BaseException:
            acceptor.close_accepted()
            for task in dials:
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result()[1].close()
            raise
        finally:
            accepting.cancel()
            for task in dials:
                task.cancel()
            await acceptor.stop()
            # (what they raised is theirs to drop; what this await raises is this task's own
            # cancellation, which must go on: swallowed, a job told to stop set up its group anyway)
            await asyncio.gather(accepting, *dials, return_exceptions=True)
        self.listener.close()  # every link is up: nobody else may join
        self.listener = None
        self._loop = loop
        for rank, sock in (*dialed, *acceptor.accepted.items()):
            link = UnixLink(rank, sock)
            self.links[rank] = link
            loop.add_reader(sock.fileno(), self._readable, link)

    # ---------------------------------------------------------------- sending
    def send(self, peer: int, msg: bytes) -> None:
        """Queue one message to peer (sent at once when the kernel takes it)."""
        link = self.links[peer]
        if link.closed:
            raise PeerLostError(f"the same-host link from rank {self.rank} to rank {peer} is closed", rank=peer)
        if len(msg) > MAX_MESSAGE:
            raise ProtocolError(f"a {len(msg)}-byte message is over the same-host limit of {MAX_MESSAGE} bytes")
        if link.pending:
            link.pending.append(msg)
            link.deferred += 1
            return
        try:
            link.sock.send(msg)
        except BlockingIOError:
            link.pending.append(msg)
            link.deferred += 1
            self.backlog += 1
            asyncio.get_running_loop().add_writer(link.sock.fileno(), self._writable, link)
            return
        except OSError as exc:
            self._ended(link, exc)
            raise PeerLostError(f"the same-host link to rank {peer} broke: {exc}", rank=peer) from exc
        link.bytes_sent += len(msg)
        link.frames_sent += 1

    def poke(self, peer: int, msg: bytes) -> None:
        """Send a message that may be lost (a wake-up): from any thread, never blocking, never queued."""
        link = self.links.get(peer)
        if link is None or link.closed:
            return
        with contextlib.suppress(OSError):  # full, or ending: the sleeper looks again within its nap
            link.sock.send(msg, socket.MSG_DONTWAIT)

    def _writable(self, link: UnixLink) -> None:
        while link.pending:
            msg = link.pending[0]
            try:
                link.sock.send(msg)
            except BlockingIOError:
                return
            except OSError as exc:
                self._ended(link, exc)
                return
            link.pending.popleft()
            link.bytes_sent += len(msg)
            link.frames_sent += 1
        asyncio.get_running_loop().remove_writer(link.sock.fileno())
        self.backlog -= 1
        self._wake_drain()

    # -------------------------------------------------------------- receiving
    def _readable(self, link: UnixLink) -> bool:
        # One message per call: the loop calls again while more are queued (level-triggered),
        # which costs less than the failing recv that ends a drain-everything loop.
        try:
            n = link.sock.recv_into(self._buf)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            self._ended(link, exc)
            return False
        if n == 0:  # messages are never empty: this is the end
            self._ended(link, None)
            return False
        link.bytes_received += n
        try:
            if n > MAX_MESSAGE:
                raise ProtocolError(f"a message over the {MAX_MESSAGE}-byte limit")
            head, payload = wire.decode_message(self._view[:n])
            self.on_message(link.peer, head, payload)
        except ProtocolError as exc:
            self._ended(link, ProtocolError(f"rank {link.peer} sent a bad same-host message: {exc}"))
        return True

    def catch_up(self, peer: int) -> None:
        link = self.links.get(peer)
        if link is not None:
            while not link.closed and self._readable(link):
                pass

    def poll(self, peers: list[int]) -> bool:
        """Take at most one waiting message from each of these peers' links, without blocking;
        True if any came."""
        got = False
        links = self.links
        for peer in peers:
            link = links[peer]
            if not link.closed and self._readable(link):
                got = True
        return got

    # ---------------------------------------------------------------- endings
    def close(self) -> None:
        """Close every link and the listener (no callbacks)."""
        super().close()
        if self.listener is not None:
            self.listener.close()
            self.listener = None


async def _dial(me: int, job: str, rank: int, peer: dict[str, Any]) -> tuple[int, socket.socket]:
    """Dial a higher rank's listening name; keep the link only if the kernel says its pid holds it."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, "\0" + str(peer["name"]))
        pid = peer_pid(sock)
        if pid != peer["pid"]:
            raise ProtocolError(
                f"the same-host socket rank {rank} published is held by pid {pid}, "
                f"not by the pid rank {rank} published ({peer['pid']})"
            )
        sock.send(msgpack.packb({"rank": me, "job": job}))
    except BaseException:
        sock.close()
        raise
    return rank, sock


class _Acceptor:
    """Accepts the lower ranks' links: each must name a rank still expected, of this job, from the
    pid that rank published (the kernel's SO_PEERCRED); anything else is closed and logged."""

    def __init__(self, listener: socket.socket, me: int, job: str, lower: dict[int, dict[str, Any]], timeout: float):
        self.listener, self.me, self.job, self.lower, self.timeout = listener, me, job, lower, timeout
        self.accepted: dict[int, socket.socket] = {}
        self.all_in = asyncio.Event()
        if not lower:
            self.all_in.set()
        self._greeters: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.all_in.is_set():
            sock, _ = await loop.sock_accept(self.listener)
            task = asyncio.ensure_future(self._greet(sock))
            self._greeters.add(task)
            task.add_done_callback(self._greeters.discard)

    async def _greet(self, sock: socket.socket) -> None:
        try:
            sock.setblocking(False)
            async with asyncio.timeout(self.timeout):
                raw = await asyncio.get_running_loop().sock_recv(sock, 4096)
            hello: Any = msgpack.unpackb(raw, raw=False) if raw else None
            rank = hello.get("rank") if isinstance(hello, dict) else None
            if (
                type(rank) is not int
                or rank not in self.lower
                or rank in self.accepted
                or hello.get("job") != self.job
                or peer_pid(sock) != self.lower[rank]["pid"]
            ):
                logger.warning(
                    "rank %d: refused a same-host link from pid %d claiming %r", self.me, peer_pid(sock), hello
                )
                sock.close()
                return
            self.accepted[rank] = sock
            if len(self.accepted) == len(self.lower):
                self.all_in.set()
        except Exception:  # a half-greeted link of any failure is dropped
            sock.close()

    def close_accepted(self) -> None:
        for sock in self.accepted.values():
            sock.close()

    async def stop(self) -> None:
        for task in list(self._greeters):
            task.cancel()
        await asyncio.gather(*self._greeters, return_exceptions=True)  # (only this task's own cancel raises)
