"""The ring's algorithms and the one place that chooses among them.

Each way the ring can reduce a tensor is one object (:class:`Algorithm`): it owns its state and plan
caches, says from the call alone whether it takes it (:meth:`Algorithm.eligible`, from the call's
size, dtype, op and the thresholds every rank agreed -- never from this rank's state), and runs it:
as a collective on the event loop (:meth:`Algorithm.run`), and where it has one, its short way with
no :class:`~psring.topology.collective.Collective` around it (:meth:`Algorithm.soon`: on the caller's
thread for the blocking API and the torch backend, or straight from the loop for the asyncio API).

:class:`Chooser` holds them in order and answers which one takes an all_reduce; the asyncio API
(``RingGroup.all_reduce``), the blocking API and the torch backend (``RingGroup.try_now``) and
the collective's own body (``RingGroup._all_reduce``) all ask it, and ``psring advise`` predicts from
the same thresholds (:mod:`psring.topology.ring.paths`). Every rank asks with the same call and the
same agreed thresholds, so every rank takes the same algorithm: the messages one rank sends are the
ones its peers wait for. The models: Horovod's ``OperationManager`` (an ordered list of ops, each
``Enabled()`` / ``Execute()``) and gloo's one class per algorithm.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..now import NOT_NOW, Now
from .context import RingContext, RingPart
from .paths import Path

if TYPE_CHECKING:
    from ..collective import Collective

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Call:
    """What an algorithm may decide by: the same on every rank for the same call."""

    nbytes: int
    size: int
    ndim: int
    dtype: np.dtype
    op: str
    #: the call is on the job's whole group (subgroups have no boards, plane, host layout or small links)
    world: bool
    #: an ordinary numpy array (cupy arrays are staged to the host first and take the general way)
    numpy: bool = True

    @classmethod
    def of(cls, x: Any, op: str, world: bool) -> Call:
        numpy = type(x) is np.ndarray
        return cls(int(x.nbytes), int(x.size), int(x.ndim), np.dtype(x.dtype), op, world, numpy)


class Algorithm(RingPart):
    """One way the ring all_reduces: a route of :class:`~psring.topology.ring.paths.Path`."""

    route: ClassVar[Path]
    #: its short way runs the whole transfer on the caller's thread (a caller with other work to overlap
    #: with the transfer -- DDP's gradient hooks -- asks for the loop instead: try_now(holds_caller=False))
    holds_caller: ClassVar[bool] = False

    def eligible(self, call: Call) -> bool:
        """Whether this algorithm takes the call (pure: the same answer on every rank)."""
        raise NotImplementedError

    def soon(self, x: np.ndarray, op: str, on_loop: bool = False) -> Now:
        """The short way, where the algorithm has one and nothing of the group is in flight: ``Done(the
        result)`` when it ended here; ``Carry(a coroutine for the loop)`` when a peer was late and the loop
        carries it on as a collective; ``NOT_NOW`` (None: nothing was done: take the loop's way)."""
        return NOT_NOW

    async def all_reduce(self, x: np.ndarray, op: str) -> Any:
        """The whole call from the event loop once the short way said not now: by default a collective
        whose body is this algorithm's :meth:`run` (Group.all_reduce_by: the checks, a Collective, then
        run) -- the chooser's decision carried by the call, not taken again."""
        return await self.ctx.all_reduce_by(x, op, self.run)

    async def run(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray:
        """The call as a collective on the loop (numbered, timed, abortable), x flat or shaped."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.route.value})"


class Chooser:
    """The ring's algorithms in the order they are tried; the first eligible one takes a call.

    The same-host ones come first (the streamed boards for the large calls, the boards for the rest),
    then the decision over the agreed thresholds (:func:`~psring.topology.ring.paths.choose_all_reduce`:
    two levels, two hops, the data plane, one hop, the pipelined ring). The answer for a numpy call
    depends only on (dtype, shape, op), so it is kept by that key: a repeated call asks one dict.
    """

    def __init__(self, ctx: RingContext, same_host: list[Algorithm], by_route: dict[Path, Algorithm]) -> None:
        self.ctx = ctx
        self.same_host = same_host
        self.by_route = by_route
        self._known: dict[tuple[Any, ...], Algorithm] = {}

    @property
    def algorithms(self) -> list[Algorithm]:
        """Every algorithm, each once, in the order the chooser tries them."""
        seen: list[Algorithm] = list(self.same_host)
        for algo in self.by_route.values():
            if algo not in seen:
                seen.append(algo)
        return seen

    def algorithm(self, x: np.ndarray, op: str) -> Algorithm:
        """The algorithm of an all_reduce of numpy array x (uncompressed)."""
        key = (x.dtype, x.shape, op)
        algo = self._known.get(key)
        if algo is None:
            algo = self.choose(Call.of(x, op, self.ctx.gid == "0"))
            if len(self._known) < 1024:
                self._known[key] = algo
            logger.debug("%r: all_reduce of %s %s %s takes %r", self.ctx, x.dtype, x.shape, op, algo)
        return algo

    def choose(self, call: Call) -> Algorithm:
        for algo in self.same_host:
            if algo.eligible(call):
                return algo
        return self.by_route[self.loop_path(call.nbytes)]

    def route(self, call: Call) -> Path:
        """The route of a call (what a trace or ``psring advise`` names)."""
        return self.choose(call).route

    def loop_path(self, nbytes: int, coded: bool = False) -> Path:
        """The route of a call that did not take the boards (RingContext.loop_path)."""
        return self.ctx.loop_path(nbytes, coded)


__all__ = ["Algorithm", "Call", "Chooser"]
