"""The ring's threaded data plane (plane.dataplane), seen from the ring: setting up its links
(and their shared-memory segments between same-host neighbours) and running large all_reduces on it.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from ....core.arrays import result_empty
from ....core.fold import pieces, reduce_op, ring_chunk_bounds
from ....core.reduceop import OPS
from ...collective import Collective
from ...now import Carry, Done, Now
from ..chooser import Algorithm, Call
from ..paths import Path
from .dataplane import DataPlane, PlaneLinkError, PlaneMismatch
from .native import Here

if TYPE_CHECKING:
    from ..context import RingContext
    from ..shortways import ShortWays

logger = logging.getLogger(__name__)

#: seconds the caller's thread runs a plane job with nothing moving before the plane's thread takes it over
PLANE_ADOPT_AFTER = 0.2
#: the largest plane job the event loop's thread runs itself (for as long as it moves, within the spin
#: budget: PSRING_SPIN_US and the call's share) instead of handing it to the plane's receive thread: the
#: loop is busy meanwhile (here about a millisecond a MiB; on a 1 Gbit/s link ten)
PLANE_ON_LOOP_MAX = 4 << 20


class PlaneAllReduce(Algorithm):
    """The PLANE route: large all_reduces of the job's group on the threaded data plane (plane.dataplane),
    from the loop, or whole on the caller's thread (:meth:`soon`) where the job runs in C."""

    route = Path.PLANE
    holds_caller = True

    def __init__(self, ctx: RingContext, short: ShortWays) -> None:
        super().__init__(ctx)
        self.short = short
        #: plane all_reduces that ended on the caller's thread (soon), and those it handed to the plane
        self.ran_now = 0
        self.adopted = 0

    def eligible(self, call: Call) -> bool:
        return self.ctx.loop_path(call.nbytes) is Path.PLANE

    async def run(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray:
        plane = self.net.plane
        assert plane is not None
        return await self.run_job(coll, x, op, plane)

    def input_order(self, count: int, nbytes: int) -> list[tuple[int, int]] | None:
        """On the data plane this rank reads its input chunk by chunk: its own chunk first
        (sent as is), then the chunks it folds, in ring order."""
        if self.ctx.loop_path(nbytes) is not Path.PLANE:
            return None
        n_ranks, me = self.world_size, self.rank
        bounds = ring_chunk_bounds(count, n_ranks)
        return [bounds[(me - k) % n_ranks] for k in range(n_ranks)]

    def _parts(self, x: np.ndarray) -> list[list[tuple[int, int]]]:
        """The plane's pieces (element ranges) of each ring chunk of flat x."""
        per_piece = max(1, self.net.config.ring_plane_piece // x.itemsize)
        return [pieces(a, b, per_piece) for a, b in ring_chunk_bounds(x.size, self.world_size)]

    def soon(self, x: Any, op: str, on_loop: bool = False) -> Now:
        """A plane all_reduce on the caller's thread (the blocking API), where the job would run in C
        (NativeJobs.kind) and nothing of the group or the plane is in flight: the caller sends and
        receives every frame itself (NativeJobs.run_here), with no hop to the event loop and the plane's
        threads and back. (True, the result); (False, a coroutine for the loop) when its peers were
        late or something is out of the ordinary: the plane's receive thread carries the job on from
        where it stands, a collective like any other; None: not this call."""
        plane = self.net.plane
        if (
            plane is None
            or on_loop  # (the loop runs a plane job in C itself, within its spin: run_job)
            or plane.native is None
            or type(x) is not np.ndarray
            or self.gid != "0"
            or self.ctx.loop_path(x.nbytes) is not Path.PLANE
            or not self.short.idle(numbered=True)
            or not plane.idle()
        ):
            return None
        native = plane.native
        kind = native.kind(x, op)
        if kind is None:
            return None
        x, seq, desc, started = self.short.number(x, op)
        flat = x.reshape(-1)
        try:
            here = native.begin_here(
                seq, msgpack.packb(desc), flat, result_empty(flat), self._parts(flat), kind, op, OPS[op].mean
            )
            done = native.run_here(here, PLANE_ADOPT_AFTER)
        except BaseException as exc:
            self.short.books(seq, desc, started, exc)
            raise
        if done:
            self.short.books(seq, desc, started, None)
            self.ran_now += 1
            return Done((here[2].reshape(x.shape),))
        self.adopted += 1
        return Carry((self._adopt(seq, x, op, started, here),))

    async def _adopt(self, seq: int, x: np.ndarray, op: str, started: float, here: Here) -> Any:
        plane = self.net.plane
        assert plane is not None
        coll = self.rt.begin("all_reduce", x, op, seq=seq, started=started)
        out = await self.rt.run(coll, self.run_job(coll, x.reshape(-1), op, plane, here))
        return out.reshape(x.shape)

    async def run_job(
        self, coll: Collective, x: np.ndarray, op: str, plane: DataPlane, here: Here | None = None
    ) -> np.ndarray:
        """all_reduce on the threaded data plane (plane.dataplane). Queued before the first
        await, so concurrent calls reach the plane in call order, the same on every rank.
        ``here``: a job the caller's thread began (soon), carried on."""
        n_ranks, me = self.world_size, self.rank
        parts = self._parts(x)
        native = plane.native
        if (
            here is None
            and native is not None
            and coll.input_wait is None
            and x.nbytes <= PLANE_ON_LOOP_MAX
            and plane.idle()
        ):
            kind = native.kind(x, op)
            if kind is not None:  # the job in C on the loop's own thread while it moves (as soon)
                call = msgpack.packb(coll.desc)
                here = native.begin_here(coll.seq, call, x, result_empty(x), parts, kind, op, OPS[op].mean)
                if native.run_here(here, self.short.spin_budget(x.nbytes)):
                    self.ran_now += 1
                    return here[2]
                self.adopted += 1
        on_error = functools.partial(self._failed, coll)  # no cycle through the job: out is freed at once
        job = plane.all_reduce(
            coll.seq,
            msgpack.packb(coll.desc),
            x,
            parts,
            reduce_op(op),
            OPS[op].mean,
            on_error,
            coll.input_wait,
            op,
            here,
        )
        coll.waiting_on = {(me - 1) % n_ranks}
        coll.data_elsewhere = True
        finished = False
        try:
            await job.done
            finished = True
        finally:
            if not finished:
                job.cancel()  # failed from elsewhere (which also cancelled job.done): the threads drop it
        return job.out

    def _failed(self, coll: Collective, exc: BaseException) -> None:
        if coll.done.done():
            return
        n_ranks, me = self.world_size, self.rank
        if isinstance(exc, PlaneMismatch):
            self.rt.abort_mismatch(coll, (me - 1) % n_ranks, exc.call)
        elif isinstance(exc, PlaneLinkError):
            self.net.plane_links.broken((me + 1) % n_ranks if exc.side == "send" else (me - 1) % n_ranks, exc, coll)
        else:
            coll.fail(exc)
