"""Event loops: uvloop where installed, and a portal that runs coroutines on a loop thread from any thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
import weakref
from collections.abc import Coroutine
from typing import Any, TextIO, TypeVar

T = TypeVar("T")

#: every loop psring made in this process, for dump_tasks
_loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed, else asyncio's default."""
    try:
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency
        loop = asyncio.new_event_loop()
    _loops.add(loop)
    return loop


def dump_tasks(out: TextIO) -> None:
    """Print every pending task of every loop psring made in this process, each with the chain of
    awaits it is suspended in (innermost last): what a hung process waits on. Safe from a signal
    handler in any thread (it reads, it never touches a loop)."""
    for loop in list(_loops):
        if loop.is_closed():
            continue
        try:
            tasks = list(asyncio.all_tasks(loop))
        except RuntimeError:  # the set changed under us: the loop runs in another thread
            continue
        for task in tasks:
            print(f"task {task.get_name()}:", file=out)
            coro: Any = task.get_coro()
            while coro is not None:
                frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                if frame is not None:
                    print(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}", file=out)
                coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    out.flush()


def poll_until(done: asyncio.Future[Any], end: float) -> None:
    """Keep the event loop polling its sockets without sleeping until ``done`` or ``end`` (a
    ``time.perf_counter()``): a callback that schedules itself again makes each turn of the loop poll
    with a zero timeout, so a frame is read as it lands instead of after the kernel wakes a sleeping
    process (tens of microseconds on a VM, the most of a small call's time over TCP). It yields its
    core between turns; other coroutines on the loop run as ever."""
    loop = done.get_loop()

    def turn() -> None:
        if not done.done() and time.perf_counter() < end:
            os.sched_yield()
            loop.call_soon(turn)

    loop.call_soon(turn)


class Portal:
    """One event loop in a daemon thread; run coroutines on it from any thread."""

    def __init__(self, name: str = "psring-loop") -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except KeyboardInterrupt:
            fut.cancel()
            raise

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()
