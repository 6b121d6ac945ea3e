"""What every short way of the ring shares: numbering a call off the loop, and closing its books.

A short way (ring.chooser: :meth:`Algorithm.soon`) runs an all_reduce with no
:class:`~psring.topology.collective.Collective` around it -- on the caller's thread for the blocking API
and the torch backend, or straight from the loop for the asyncio API -- when nothing of the group is in
flight. It takes the group's next number as the loop would, reserves it (so a peer's abort or early
message for it is kept), and when the call ends records it as the loop's ``_end`` would: the runtime's
tickets (``CollectiveRuntime.ticket``, ``close_number``). The boards, the TCP one-hop and two-hop calls and
the data plane all go through here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...core.arrays import dtype_name
from ...core.fold import check_op

if TYPE_CHECKING:
    from .context import RingContext

#: a rank spins PSRING_SPIN_US plus this per byte the call moves on the host (its size times the ranks)
#: before it sleeps: a peer is late by the copy and fold of a larger call, and waking an asleep rank
#: through the loop costs more than that (docs/performance-history.md, "Waiting on the boards")
SPIN_PER_BYTE = 1e-9
#: and at most this much in all (a spinning rank takes a core its late peers may need)
SPIN_MAX = 0.02


class ShortWays:
    """A ring group's helpers for calls that take a short way (one per group): the checks, the numbers
    (the runtime's tickets), the spin budget and the scratch rows of a call alone in flight."""

    def __init__(self, ctx: RingContext) -> None:
        self.net = ctx.net
        self.world_size = ctx.world_size
        self.rt = ctx.runtime
        self._valid: set[tuple[str, np.dtype]] = set()
        #: the buffer alone_rows gives out (replaced by a larger one when a call needs more)
        self.scratch: np.ndarray | None = None

    def idle(self, numbered: bool = False) -> bool:
        """Whether a call may take a short way now: this rank runs a loop and nothing of the group is in
        flight there, numbered for later, or failed and not yet raised (CollectiveRuntime.quiet)."""
        return self.net.loop is not None and self.rt.quiet(numbered)

    def checked(self, x: np.ndarray, op: str) -> np.ndarray:
        """x, contiguous, once its dtype and op passed the checks every path makes (TypeError,
        ValueError naming what is wrong)."""
        key = (op, x.dtype)
        if key not in self._valid:
            dtype_name(x.dtype)  # TypeError for a dtype psring does not carry, as on every path
            check_op(op, x.dtype)
            self._valid.add(key)
        return x if x.flags.c_contiguous else np.ascontiguousarray(x)

    def number(self, x: np.ndarray, op: str) -> tuple[np.ndarray, int, tuple[Any, ...], float]:
        """Check an all_reduce a short way takes and number it: (x, contiguous; its number; its call
        descriptor; when it began). The runtime's ticket: its number is reserved, so a peer's abort or
        early frame for it is kept, until books (or the loop's adoption) releases it."""
        x = self.checked(x, op)
        t = self.rt.ticket(x, op)
        return x, t.seq, t.desc, t.started

    def books(self, seq: int, desc: tuple[Any, ...], started: float, error: BaseException | None) -> None:
        """A call a short way ended: as the loop's _end would (CollectiveRuntime.close_number)."""
        self.rt.close_number(seq, desc, started, error)

    def spin_budget(self, nbytes: int) -> float:
        """Seconds a waiting rank polls before it sleeps: PSRING_SPIN_US and the call's share."""
        return min(self.net.config.spin_s + nbytes * self.world_size * SPIN_PER_BYTE, SPIN_MAX)

    def alone_rows(self, n: int, count: int, dtype: np.dtype) -> np.ndarray:
        """``n`` rows of ``count`` elements (uninitialized) for a call alone in flight -- the caller's
        thread's, or the loop's while nothing else of the group is active -- in one buffer the group keeps
        and grows: such a call pays neither page faults nor the buffer pool's upkeep. A call alone ends
        (or is adopted and ends on the loop) before the next begins, so one buffer serves all of them."""
        nbytes = n * count * dtype.itemsize
        buf = self.scratch
        if buf is None or buf.nbytes < nbytes:
            buf = self.scratch = np.empty(nbytes, np.uint8)
        return buf[:nbytes].view(dtype).reshape(n, count)


__all__ = ["SPIN_MAX", "SPIN_PER_BYTE", "ShortWays"]
