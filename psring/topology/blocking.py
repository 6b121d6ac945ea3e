"""The blocking facade: ``psring.init()`` runs the async core on a background loop thread.

Each blocking method submits the coroutine to that loop and waits; ``async_op=True``
returns a :class:`Handle` instead (isend/irecv-style overlap from plain scripts).
The async Group is the only implementation; where its ``try_now`` has a short way for an all_reduce
(the ring's boards, TCP one- and two-hop calls, data plane in C), a blocking call with nothing of this
group in flight runs there, on the caller's thread, without the hop to the loop and back.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import weakref
from collections.abc import Mapping
from typing import Any

from ..transport.loop import Portal
from .api import init_group
from .now import Done
from .stall import install_dump_signal


class Handle:
    """The result of an ``async_op=True`` call: ``wait()``, ``done()``, ``exception()``."""

    def __init__(self, future: concurrent.futures.Future[Any]) -> None:
        self._future = future

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operation finishes and return its result (or raise its error)."""
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"operation not finished within {timeout:g}s") from None

    def done(self) -> bool:
        return self._future.done()

    def exception(self) -> BaseException | None:
        """The error it failed with (None if it succeeded); blocks until it finishes."""
        return self._future.exception()


_live: weakref.WeakSet[BlockingGroup] = weakref.WeakSet()


def _blocking(name: str) -> Any:
    def method(self: BlockingGroup, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        if self._pending:
            self._pending = [f for f in self._pending if not f.done()]
        return self._on_loop(getattr(self._group, name)(*args, **kwargs), async_op)

    method.__name__ = name
    method.__doc__ = f"Blocking {name}; async_op=True returns a Handle."
    return method


class BlockingGroup:
    """A Group driven from ordinary (non-async) code."""

    def __init__(self, group: Any, portal: Portal, owns_portal: bool) -> None:
        self._group = group
        self._portal = portal
        self._owns_portal = owns_portal
        self._closed = False
        #: async_op calls not known to be done: while there are any, every call takes the loop (in order)
        self._pending: list[concurrent.futures.Future[Any]] = []
        _live.add(self)

    @property
    def rank(self) -> int:
        return int(self._group.rank)

    @property
    def world_size(self) -> int:
        return int(self._group.world_size)

    @property
    def topology(self) -> str:
        return str(self._group.topology)

    @property
    def group(self) -> Any:
        """The async Group underneath (use it from coroutines run on ``portal``)."""
        return self._group

    @property
    def portal(self) -> Portal:
        return self._portal

    def all_reduce(
        self, x: Any, op: str = "sum", compression: Any = None, *, async_op: bool = False
    ) -> Any:
        """Blocking all_reduce; async_op=True returns a Handle. On the caller's thread where the group has a
        short way for the call and nothing is in flight (Group.try_now: the ring's boards, its TCP one- and
        two-hop calls, its data plane in C): no hop to the event loop and none back."""
        if not async_op and not self._pending:
            now = self._group.try_now(x, op, compression)
            if isinstance(now, Done):
                return now.value
            if now is not None:
                return self._on_loop(now.rest, False)
        elif self._pending:
            self._pending = [f for f in self._pending if not f.done()]
        return self._on_loop(self._group.all_reduce(x, op, compression), async_op)

    def _on_loop(self, coro: Any, async_op: bool) -> Any:
        """Run coro on the portal's loop: its result (this thread waits), or a Handle (async_op)."""
        fut = self._portal.submit(coro)
        if async_op:
            self._pending.append(fut)
            return Handle(fut)
        try:
            return fut.result()
        except KeyboardInterrupt:
            fut.cancel()
            raise

    broadcast = _blocking("broadcast")
    barrier = _blocking("barrier")
    all_gather = _blocking("all_gather")
    sparse_all_reduce = _blocking("sparse_all_reduce")
    reduce_scatter = _blocking("reduce_scatter")
    reduce = _blocking("reduce")
    scatter = _blocking("scatter")
    gather = _blocking("gather")
    send = _blocking("send")
    recv = _blocking("recv")
    recv_any = _blocking("recv_any")

    def new_group(self, ranks: list[int]) -> BlockingGroup:
        sub = self._portal.call(self._group.new_group(ranks))
        return BlockingGroup(sub, self._portal, owns_portal=False)

    def stats(self) -> dict[str, int]:
        return dict(self._group.stats())

    def link_stats(self) -> dict[str, list[int]]:
        """Bytes [sent, received] per link of this rank (see Group.link_stats)."""
        return dict(self._group.link_stats())

    def close(self) -> None:
        """Close the group and stop its loop thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self._portal.loop.is_closed():
                self._portal.call(self._group.close(), timeout=10)
        finally:
            if self._owns_portal:
                self._portal.stop()

    def __enter__(self) -> BlockingGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Blocking{self._group!r}"


def init(
    topology: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    store: Any = None,
    secret: str | bytes | None = None,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    **options: Any,
) -> BlockingGroup:
    """Blocking ``init_group``: same arguments; returns a :class:`BlockingGroup`."""
    portal = Portal()
    try:
        group = portal.call(
            init_group(
                topology=topology,
                rank=rank,
                world_size=world_size,
                store=store,
                secret=secret,
                timeout=timeout,
                env=env,
                **options,
            )
        )
    except BaseException:
        portal.stop()
        raise
    install_dump_signal()  # here, in the caller's thread: the loop thread cannot take signals
    return BlockingGroup(group, portal, owns_portal=True)


@atexit.register
def _close_all() -> None:
    for group in list(_live):
        try:
            group.close()
        except Exception:  # at exit: one group's failed close must not stop the others'
            pass


__all__ = ["BlockingGroup", "Handle", "init"]
