"""Group: the collectives interface both topologies implement (``init_group`` is in ``api``).

The base class owns everything the topologies share: argument checks, the call
descriptor every frame carries (so a rank that called a different collective, or the
same one with another dtype/shape/op, is named in a ``MismatchError`` on every rank),
device staging for cupy arrays, and the hooks each topology fills in. The life of one
collective -- sequence numbers, deadlines naming the silent ranks, aborts that every
rank takes together (so the group stays usable), peer loss -- is in ``runtime``.

Knows peers and frames, not models or sockets.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import traceback
import warnings
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from ..core import gpu
from ..core.arrays import array_module, check_array, cupy_module, is_cupy
from ..core.codec import Codec, codec_named
from ..core.fold import check_op
from ..core.sparse import SparseRows
from ..errors import (
    GroupClosedError,
    PeerLostError,
    PsringError,
)
from ..rendezvous.scheduler import GroupSettings
from ..settings import Settings
from ..transport.mailbox import Mailbox
from .collective import Collective
from .now import NOT_NOW, Now
from .p2p import PointToPoint
from .runtime import CollectiveRuntime
from .sparsecall import sparse_all_reduce

logger = logging.getLogger(__name__)

#: an all_reduce's body on the loop: (the collective, the flat host array, op) -> the flat result
Body = Callable[[Collective, np.ndarray, str], Awaitable[np.ndarray]]

#: with PSRING_GPU_OVERLAP=1, cupy all_reduces of at least this many bytes copy their input off
#: the device range by range while the network already moves the first ranges (where the
#: implementation can: the ring's data plane). Off by default: with 4 ranks sharing one GPU it
#: measured slower (docs/gpu.md).
STREAM_MIN_BYTES = 1 << 20


def farewell(groups: dict[str, Group], stopped_at: dict[str, int]) -> dict[str, Any]:
    """The goodbye a connection layer sends: per group, the first collective this rank did not finish."""
    for gid, group in groups.items():
        stopped_at.setdefault(gid, group.stopped_at())
    return {"seqs": stopped_at}


class Group(CollectiveRuntime):
    """A set of ranks running collectives together; ``ring`` and ``ps`` implement it."""

    registry: ClassVar[dict[str, type[Group]]] = {}
    #: the topology's own home for the parameters (the parameter server's shards: a ParameterClient) and
    #: for sparse tables (SparseTables); None where every rank keeps them (training.placement reads these)
    params: Any = None
    tables: Any = None
    members: list[int]  #: the world ranks of this group's ranks, in its rank order

    def quorum(self) -> Any:
        """The elastic membership that re-forms this group's survivors after a loss (the ring's
        ``ring.quorum.Quorum``; SyncSGD(elastic=True) takes it); None where the topology has none
        (the parameter server keeps the model itself and averages over the workers still there)."""
        return None

    def __init__(
        self, rank: int, world_size: int, *, timeout: float, gid: str, mailbox: Mailbox, config: Settings
    ) -> None:
        super().__init__(rank, world_size, timeout=timeout, gid=gid, mailbox=mailbox, config=config)
        self._subgroups = 0
        self.p2p = PointToPoint(self, self._send, self._layer)  # send, recv, recv_any
        self._created_at = "".join(traceback.format_stack(limit=8)[:-1])
        self.bytes_sent = 0

    @classmethod
    @abc.abstractmethod
    async def create(cls, settings: GroupSettings, **options: Any) -> Group:
        """Form this topology's group of ``settings.world_size`` ranks (``init_group`` calls it with
        the settings it resolved); ``options`` are the topology's own (``init_group(**options)``)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.topology:
            Group.registry[cls.topology] = cls

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}/{self.world_size}, gid={self.gid})"

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and getattr(self, "_owns_resources", False):
            warnings.warn(f"unclosed {self!r}; created at:\n{self._created_at}", ResourceWarning, stacklevel=1)

    async def __aenter__(self) -> Group:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---------------------------------------------------------- device staging
    # -------------------------------------------------------- public collectives
    async def all_reduce(self, x: Any, op: str = "sum", compression: str | Codec | None = None) -> Any:
        """Reduce x over all ranks with op; every rank gets the result (a new array).

        ``compression``: a codec's name (``"fp16"``: float32 x, op sum or avg, float16 on the
        wire) or a :class:`psring.core.codec.Codec`. The ranks first agree on the codec's scale
        (a one-element max all_reduce), then fold in float32 in the canonical order, rounding every
        partial sum as the codec says; see :mod:`psring.core.codec`.
        """
        if compression is None and is_cupy(x) and self.config.gpu_overlap:
            x = check_array(x)
            order = self._input_order(x.size, x.nbytes) if x.nbytes >= STREAM_MIN_BYTES else None
            if order is not None:
                return await self._all_reduce_streamed(x, op, order)
        host, xp = gpu.host_of(x)
        check_op(op, host.dtype)
        codec = codec_named(compression)
        if codec is not None:
            codec.check(host.dtype, op)
            e, seq = 0, None
            if codec.scaled:  # the ranks agree on the scale first
                amax = codec.amax(host.reshape(-1))
                agree = self.begin("all_reduce", amax, "max")
                (seq,) = self.reserve(1)  # now, so concurrent calls take the same numbers on every rank
                try:
                    amax = await self.run(agree, self._all_reduce(agree, amax, "max"))
                    e = codec.scale(amax, self.world_size)  # may refuse what it cannot carry: every rank alike
                except BaseException:
                    self.give_back([seq])
                    raise
            coll = self.begin("all_reduce", host, codec.descriptor(op, e), seq=seq)
            out = await self.run(coll, self._all_reduce_coded(coll, host.reshape(-1), op, codec, e))
            return gpu.back_to(out.reshape(host.shape), xp)
        coll = self.begin("all_reduce", host, op)
        out = await self.run(coll, self._all_reduce(coll, host.reshape(-1), op))
        return gpu.back_to(out.reshape(host.shape), xp)

    async def all_reduce_by(self, x: np.ndarray, op: str, body: Body) -> np.ndarray:
        """all_reduce of host array x as a collective whose body is ``body`` (coll, flat x, op) -> the flat
        result: a topology's algorithm, chosen once for the call (the same checks as all_reduce's)."""
        host, _ = gpu.host_of(x)
        check_op(op, host.dtype)
        coll = self.begin("all_reduce", host, op)
        out = await self.run(coll, body(coll, host.reshape(-1), op))
        return out.reshape(host.shape)

    async def _all_reduce_streamed(self, x: Any, op: str, order: list[tuple[int, int]]) -> Any:
        """all_reduce of a cupy array whose copy to the host overlaps the network: the
        implementation reads the input range by range in ``order`` (see _input_order)."""
        staged = stage_in_order(x, order)
        try:
            host = staged.host.reshape(x.shape)
            check_op(op, host.dtype)
            coll = self.begin("all_reduce", host, op)
            coll.input_wait = staged.wait
            out = await self.run(coll, self._all_reduce(coll, host.reshape(-1), op))
        finally:
            staged.wait_all()  # no copy may still be writing when the buffer goes back to the pool
        return gpu.back_to(out.reshape(x.shape), array_module(x))

    def _input_order(self, count: int, nbytes: int) -> list[tuple[int, int]] | None:
        """The element ranges, in the order this implementation's all_reduce of a tensor this
        size reads its input, when it can start before all of it is in host memory (then it
        calls ``coll.input_wait`` before reading each range); None: it needs it all at once."""
        return None

    def try_now(self, x: Any, op: str = "sum", compression: Any = None, holds_caller: bool = True) -> Now:
        """all_reduce on the caller's thread, off the event loop, where this group has a short way for
        the call and nothing of it is in flight: :class:`~psring.topology.now.Done` (the result),
        :class:`~psring.topology.now.Carry` (a peer was late: a coroutine for the loop finishes it), or
        ``NOT_NOW`` (None: nothing was done; call :meth:`all_reduce`). The blocking facade and the torch
        backend ask it. ``holds_caller=False``: not a way that holds the caller's thread for the whole
        transfer (a caller with other work to overlap with it). By default, never now."""
        return NOT_NOW

    async def broadcast(self, x: Any, src: int = 0) -> Any:
        """Every rank gets src's x; other ranks pass an array of the same shape and dtype."""
        self.check_rank(src, "src")
        host, xp = gpu.host_of(x)
        coll = self.begin("broadcast", host, None, src)
        out = await self.run(coll, self._broadcast(coll, host.reshape(-1), src))
        return gpu.back_to(out.reshape(host.shape), xp)

    async def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        coll = self.begin("barrier")
        await self.run(coll, self._barrier(coll))

    async def all_gather(self, x: Any) -> list[Any]:
        """A list of every rank's x, in rank order."""
        host, xp = gpu.host_of(x)
        coll = self.begin("all_gather", host)
        out = await self.run(coll, self._all_gather(coll, host.reshape(-1)))
        return [gpu.back_to(out[r].reshape(host.shape), xp) for r in range(self.world_size)]

    async def sparse_all_reduce(self, rows: SparseRows) -> SparseRows:
        """Every rank's rows summed: unique sorted indices, each index's rows added in rank order
        (then in each rank's own order). The same bits on every rank and on both topologies.

        Rows whose index is out of range, a width, table height or dtype another rank does not
        share: a ValueError (MismatchError for disagreement) naming the ranks, on every rank;
        nothing is summed and the group stays usable.
        """
        return await sparse_all_reduce(self, self._all_gather, rows)

    async def reduce_scatter(self, x: Any, op: str = "sum") -> Any:
        """This rank's 1/world_size share of the reduction of x.

        The share is ring chunk ``rank`` of the flattened tensor; when ``x.shape[0]``
        divides by world_size that is rows ``rank*k:(rank+1)*k`` and keeps the trailing
        shape, otherwise it is a flat slice. Bits equal the same slice of all_reduce's.
        """
        host, xp = gpu.host_of(x)
        check_op(op, host.dtype)
        coll = self.begin("reduce_scatter", host, op)
        flat = await self.run(coll, self._reduce_scatter(coll, host.reshape(-1), op))
        n = self.world_size
        if host.ndim >= 1 and host.shape[0] % n == 0:
            flat = flat.reshape((host.shape[0] // n, *host.shape[1:]))
        return gpu.back_to(flat, xp)

    async def reduce(self, x: Any, dst: int = 0, op: str = "sum") -> Any:
        """The reduction on dst (None elsewhere); same bits as all_reduce."""
        self.check_rank(dst, "dst")
        host, xp = gpu.host_of(x)
        check_op(op, host.dtype)
        coll = self.begin("reduce", host, op, dst)
        out = await self.run(coll, self._reduce(coll, host.reshape(-1), op, dst))
        return None if out is None else gpu.back_to(out.reshape(host.shape), xp)

    async def gather(self, x: Any, dst: int = 0) -> list[Any] | None:
        """A list of every rank's x on dst (None elsewhere)."""
        self.check_rank(dst, "dst")
        host, xp = gpu.host_of(x)
        coll = self.begin("gather", host, None, dst)
        out = await self.run(coll, self._gather(coll, host.reshape(-1), dst))
        if out is None:
            return None
        return [gpu.back_to(out[r].reshape(host.shape), xp) for r in range(self.world_size)]

    async def scatter(self, xs: Sequence[Any] | None, src: int = 0) -> Any:
        """Rank r gets xs[r] from src; xs is a list of world_size arrays on src, None elsewhere."""
        self.check_rank(src, "src")
        if self.rank == src:
            if xs is None or len(xs) != self.world_size:
                got = "None" if xs is None else f"{len(xs)} arrays"
                raise ValueError(f"scatter on src rank {src} needs a list of {self.world_size} arrays, got {got}")
            staged = [gpu.host_of(x) for x in xs]
            first = staged[0][0]
            for i, (h, _xp) in enumerate(staged):
                if h.shape != first.shape or h.dtype != first.dtype:
                    raise ValueError(
                        f"scatter: xs[{i}] has shape {h.shape} dtype {h.dtype}, xs[0] has {first.shape} {first.dtype}"
                    )
            stacked = (
                np.stack([h for h, _ in staged])
                if first.size
                else np.empty((self.world_size, *first.shape), first.dtype)
            )
            head: tuple[np.ndarray | None, Any] = (stacked, staged[0][1])
            meta = np.empty(first.shape, first.dtype)
        else:
            if xs is not None:
                raise ValueError(f"scatter: xs must be None on rank {self.rank} (only src {src} passes arrays)")
            head = (None, None)
            meta = None
        coll = self.begin("scatter", None, None, src)
        out, (_dtype, shape), dev = await self.run(coll, self._scatter(coll, head[0], src, meta))
        xp = head[1] if head[1] is not None else (cupy_module() if dev == "cuda" else np)
        return gpu.back_to(out.reshape(shape), xp)

    async def send(self, x: Any, dst: int) -> None:
        """Send x to rank dst (returns once the bytes left this process)."""
        await self.p2p.send(x, dst)

    async def recv(self, src: int, timeout: float | None = None) -> Any:
        """The next array rank src sent to this rank, as the type it was sent as."""
        return await self.p2p.recv(src, timeout)

    async def recv_any(self, timeout: float | None = None) -> tuple[int, Any]:
        """The next array any rank sent to this rank, and the rank that sent it (torch's recv
        without src). Each sender's arrays still come in the order it sent them; between senders,
        the first to arrive is taken. A recv from a given src posted meanwhile keeps that src's
        next array for itself."""
        return await self.p2p.recv_any(timeout)

    async def new_group(self, ranks: Sequence[int]) -> Group | NonMemberGroup:
        """A Group over ranks (renumbered 0..k-1); every rank of this group must call it.

        Ranks outside ``ranks`` get a NonMemberGroup whose every call raises a clear error.
        """
        ranks = list(ranks)
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"new_group: ranks {ranks} must be a non-empty list without repeats")
        for r in ranks:
            self.check_rank(r, "ranks[]")
        self.check_usable()
        self._subgroups += 1
        gid = f"{self.gid}.{self._subgroups}"
        if self.rank not in ranks:
            return NonMemberGroup(self.rank, ranks, gid)
        return self.make_subgroup(gid, ranks)

    # --------------------------------------------------------- topology hooks
    @abc.abstractmethod
    async def _all_reduce(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray: ...

    @abc.abstractmethod
    async def _all_reduce_coded(self, coll: Collective, x: np.ndarray, op: str, codec: Codec, e: Any) -> np.ndarray:
        """all_reduce of float32 x as ``codec`` carries it, at scale exponent e (psring.core.codec)."""

    @abc.abstractmethod
    async def _reduce_scatter(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray: ...

    @abc.abstractmethod
    async def _broadcast(self, coll: Collective, x: np.ndarray, src: int) -> np.ndarray: ...

    @abc.abstractmethod
    async def _barrier(self, coll: Collective) -> None: ...

    @abc.abstractmethod
    async def _all_gather(self, coll: Collective, x: np.ndarray) -> np.ndarray: ...

    @abc.abstractmethod
    async def _reduce(self, coll: Collective, x: np.ndarray, op: str, dst: int) -> np.ndarray | None: ...

    @abc.abstractmethod
    async def _gather(self, coll: Collective, x: np.ndarray, dst: int) -> np.ndarray | None: ...

    @abc.abstractmethod
    async def _scatter(
        self, coll: Collective, xs: np.ndarray | None, src: int, meta: np.ndarray | None
    ) -> tuple[np.ndarray, tuple[str, tuple[int, ...]], str]: ...

    @abc.abstractmethod
    async def _send(self, x: np.ndarray, dst: int, n: int, device: str) -> None: ...

    @abc.abstractmethod
    def make_subgroup(self, gid: str, ranks: list[int]) -> Group: ...

    async def close(self) -> None:
        """Leave the group: pending calls fail here; peers learn which collectives this rank finished."""
        if self._closed:
            return
        layer = self._layer()
        layer.stopped_at[self.gid] = self.stopped_at()
        self._closed = True
        layer.groups.pop(self.gid, None)
        if self._late_error is not None:
            logger.error("%r closes without having raised: %s", self, self._late_error)
        for coll in list(self._active.values()):
            coll.fail(PeerLostError(f"{self!r} was closed while {coll.label} was pending"))
        if self.gid == "0":
            await asyncio.shield(layer.close())

    def fail_recv(self, src: int, err: PsringError) -> None:
        """End the recvs from world rank src in progress with err (the stall inspector's verdict)."""
        if src in self.members:
            self.p2p.fail(self.members.index(src), err)

    def stats(self) -> dict[str, int]:
        """Bytes and frames this rank's connections sent and received."""
        return {"bytes_sent": 0, "bytes_received": 0}

    def per_shard(self) -> list[tuple[int, int]]:
        """(bytes sent to, received from) each server shard of the topology; [] where it has none."""
        return []

    def link_stats(self) -> dict[str, list[int]]:
        """Bytes [sent, received] per link of this rank ("rank 2", "shard 0", "shared memory",
        "data plane (TCP)")."""
        layer = self._layer()
        return layer.link_stats() if layer is not None and hasattr(layer, "link_stats") else {}


class NonMemberGroup:
    """What new_group returns on ranks outside the subset: every call raises."""

    def __init__(self, rank: int, ranks: list[int], gid: str) -> None:
        self.rank = -1
        self.world_size = len(ranks)
        self.gid = gid
        self._message = f"this process (parent rank {rank}) is not a member of subgroup {gid} over ranks {ranks}"

    def try_now(self, x: Any, op: str = "sum", compression: Any = None, holds_caller: bool = True) -> Now:
        return NOT_NOW  # (all_reduce then refuses)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        async def refuse(*args: Any, **kwargs: Any) -> Any:
            if name == "close":
                return None
            raise GroupClosedError(self._message)

        return refuse

    def __repr__(self) -> str:
        return f"NonMemberGroup({self.gid})"


# ------------------------------------------------------------------ staging
def stage_to_host(x: Any) -> np.ndarray:
    """Copy a cupy array to host memory (pinned staging buffers are reused)."""

    return gpu.to_host(x)


def stage_in_order(x: Any, order: list[tuple[int, int]]) -> Any:
    """Start copying a cupy array to pinned host memory range by range (gpu.StagedInput)."""

    return gpu.StagedInput(x, order)


def stage_to_device(y: np.ndarray, xp: Any) -> Any:

    return gpu.to_device(y, xp)
