"""Point to point: a group's send, recv and recv from any source (one object per group).

Each (sender, receiver) pair numbers its arrays: the n-th array a rank sends to another travels under
the tag ``(gid, "p2p", sender, n)``, so a receiver takes each sender's arrays in the order they were
sent, whichever way they travelled (the topology's ``_send``). A recv waits in slices, so it names a
lost or departed sender, its deadline, or what the stall inspector found (a recv that cannot be
matched), instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core import gpu, wire
from ..core.arrays import cupy_module
from ..errors import CollectiveTimeoutError, MismatchError, PeerLostError, ProtocolError, PsringError
from .runtime import RecvWait

if TYPE_CHECKING:
    from .runtime import CollectiveRuntime

#: how a group sends an array to a peer: (host array, dst, its number to that peer, "cpu" or "cuda")
Send = Callable[[np.ndarray, int, int, str], Awaitable[None]]


class PointToPoint:
    """A group's point-to-point arrays: what it sent and took from each peer, and the recvs waiting."""

    def __init__(self, group: CollectiveRuntime, send: Send, layer: Callable[[], Any]) -> None:
        self.group = group
        self._send = send
        #: the connection layer under the group (its stall inspector is told of long recvs)
        self._layer = layer
        self.sent: dict[int, int] = {}
        self.taken: dict[int, int] = {}
        #: recvs in progress, by (src, n): the stall inspector reads and ends them (fail)
        self.waits: dict[tuple[int, int], RecvWait] = {}

    async def send(self, x: Any, dst: int) -> None:
        g = self.group
        g.check_rank(dst, "dst")
        if dst == g.rank:
            raise ValueError(f"send: dst={dst} is this rank; use a local copy")
        g.check_usable(peer=dst)
        host, xp = gpu.host_of(x)
        n = self.sent.get(dst, 0)
        self.sent[dst] = n + 1
        await self._send(host, dst, n, "cuda" if xp is not np else "cpu")

    async def recv(self, src: int, timeout: float | None = None) -> Any:
        g = self.group
        g.check_rank(src, "src")
        if src == g.rank:
            raise ValueError(f"recv: src={src} is this rank")
        g.check_usable(peer=src, receiving=True)
        n = self.taken.get(src, 0)
        self.taken[src] = n + 1
        try:
            y, dev = await self.take(src, n, g.timeout if timeout is None else timeout)
        except MismatchError:
            if self.taken.get(src) == n + 1:  # nothing was taken: the next recv waits for the same send
                self.taken[src] = n
            raise
        return gpu.back_to(y, _module(dev))

    async def recv_any(self, timeout: float | None = None) -> tuple[int, Any]:
        g = self.group
        g.check_usable(receiving=True)
        loop = asyncio.get_running_loop()
        got: asyncio.Future[tuple[int, dict[str, Any], Any]] = loop.create_future()
        posted: dict[int, tuple[Any, ...]] = {}

        def taker(src: int, tag: tuple[Any, ...]) -> Any:
            def take(conn: Any, header: dict[str, Any], payload: Any) -> None:
                # runs inside the delivery of the frame: the others are unposted before any other
                # frame can arrive, so exactly one is taken
                for other in posted.values():
                    if other != tag:
                        g.mailbox.unpost(other)
                self.taken[src] = self.taken.get(src, 0) + 1
                got.set_result((src, header, payload))

            return take

        for src in range(g.world_size):
            if src == g.rank or g.departed(src) is not None:
                continue
            tag = (g.gid, "p2p", src, self.taken.get(src, 0))
            if g.mailbox.is_posted(tag):
                continue  # a recv(src) waits for it
            posted[src] = tag
            g.mailbox.post(tag, callback=taker(src, tag))
            if got.done():  # one had arrived already: taken, the rest not posted
                break
        limit = g.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        try:
            while not got.done():
                g.check_usable(receiving=True)
                if not posted:
                    raise PeerLostError(f"recv from any source on rank {g.rank}: no other rank can send")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CollectiveTimeoutError(
                        f"recv from any source on rank {g.rank} timed out after {limit:g}s", missing=tuple(posted)
                    )
                with contextlib.suppress(asyncio.TimeoutError):
                    async with asyncio.timeout(min(remaining, 0.25)):
                        await asyncio.shield(got)
        finally:
            if not got.done():
                for tag in posted.values():
                    g.mailbox.unpost(tag)
        src, hdr, payload = got.result()
        if "dtype" not in hdr:
            raise ProtocolError(f"frame from rank {src} carries no array")
        return src, gpu.back_to(wire.decode_tensor(hdr, payload), _module(str(hdr.get("dev", "cpu"))))

    async def take(self, src: int, n: int, timeout: float) -> tuple[np.ndarray, str]:
        """The n-th array src sent this rank (whichever way it travelled), and its device."""
        g = self.group
        tag = (g.gid, "p2p", src, n)
        fut = g.mailbox.expect(tag)
        deadline = time.monotonic() + timeout
        wait = self.waits[(src, n)] = RecvWait()
        try:
            while True:
                if fut.done():  # it arrived before anything went wrong: deliver it
                    _conn, hdr, payload = fut.result()
                    break
                if wait.error is not None:  # the stall inspector found this recv deadlocked
                    raise wait.error
                g.check_usable(peer=src, receiving=True)
                if g.departed(src) is not None:  # it left, and everything it sent has arrived
                    raise PeerLostError(f"recv from rank {src}: {g.departed(src)}", rank=src)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CollectiveTimeoutError(
                        f"recv on rank {g.rank} from rank {src} timed out after {timeout:g}s", missing=(src,)
                    )
                if time.monotonic() - wait.started >= g.config.stall * (wait.stalled + 1):
                    wait.stalled += 1
                    self._layer().stalls.stalled(g, recv=(src, n, wait))
                with contextlib.suppress(asyncio.TimeoutError):
                    async with asyncio.timeout(min(remaining, 0.25)):
                        _conn, hdr, payload = await asyncio.shield(fut)
                    break
        finally:
            del self.waits[(src, n)]
            if wait.stalled:
                self._layer().stalls.resolved(g, None, wait.error)
            g.mailbox.unpost(tag)
            if not fut.done():
                fut.cancel()
        if "dtype" not in hdr:
            raise ProtocolError(f"frame from rank {src} carries no array")
        return wire.decode_tensor(hdr, payload), str(hdr.get("dev", "cpu"))

    def fail(self, local: int, err: PsringError) -> None:
        """End the recvs from rank ``local`` of the group in progress with err (the stall inspector's verdict)."""
        for (s, _n), wait in self.waits.items():
            if s == local:
                wait.error = err


def _module(dev: str) -> Any:
    """The array module a received array goes back as (cupy where it was sent from a GPU and is here)."""
    return cupy_module() if dev == "cuda" and cupy_module() is not None else np


__all__ = ["PointToPoint"]
