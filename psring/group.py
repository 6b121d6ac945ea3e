"""Group: the collectives interface both topologies implement, and ``init_group``.

The base class owns everything the topologies share: argument checks, sequence
numbers, the call descriptor every frame carries (so a rank that called a different
collective, or the same one with another dtype/shape/op, is named in a
``MismatchError`` on every rank), per-collective deadlines naming the silent ranks,
abort propagation (a timed-out or mismatched collective is abandoned by all ranks
together, so the group stays usable), peer loss (the group is then broken), device
staging for cupy arrays, and the canonical reduction order.

Knows peers and frames, not models or sockets.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import logging
import os
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from . import wire
from .arrays import REDUCE_OPS, array_module, check_array, cupy_module, dtype_name, is_cupy
from .compress import check_codec, codec_op, scale_exponent
from .connection import Connection, Mailbox
from .errors import (
    CollectiveTimeoutError,
    GroupClosedError,
    MismatchError,
    PeerLostError,
    ProtocolError,
    PsringError,
)

logger = logging.getLogger(__name__)

#: callables called with a record (seq, rank, kind, bytes, start, end, ok, ...) after every
#: collective: the flight recorder (psring.observe) and the metrics use them; empty by default
OBSERVERS: list[Any] = []

#: tensors up to this many bytes use the one-hop paths (all ranks exchange whole tensors)
SMALL_BYTES = 64 << 10
#: with PSRING_GPU_OVERLAP=1, cupy all_reduces of at least this many bytes copy their input off
#: the device range by range while the network already moves the first ranges (where the
#: implementation can: the ring's data plane). Off by default: with 4 ranks sharing one GPU it
#: measured slower (README, GPU).
STREAM_MIN_BYTES = 1 << 20


def gpu_overlap() -> bool:
    """PSRING_GPU_OVERLAP=1: overlap a cupy all_reduce's device-to-host copy with the network."""
    raw = os.environ.get("PSRING_GPU_OVERLAP", "0").strip()
    if raw not in ("0", "1", ""):
        raise ValueError(f"PSRING_GPU_OVERLAP must be 0 or 1, got {raw!r}")
    return raw == "1"


_UFUNCS = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def ring_chunk_bounds(n: int, world_size: int) -> list[tuple[int, int]]:
    """Split n elements into world_size contiguous ring chunks (the canonical split)."""
    return [(c * n // world_size, (c + 1) * n // world_size) for c in range(world_size)]


def reduce_op(op: str) -> np.ufunc:
    return _UFUNCS[op]


def canonical_fold(
    parts: Sequence[np.ndarray], op: str, out: np.ndarray, offset: int = 0, total: int | None = None
) -> np.ndarray:
    """Reduce flat arrays parts[0..N-1] into out in the canonical order.

    Element i in ring chunk c is ((x_c op x_c+1) op ...) op x_c-1 (ranks mod N); for
    avg the sum is then divided by N. Every topology reproduces exactly this. The
    arrays may hold a window [offset, offset + out.size) of a flat tensor of ``total``
    elements (a parameter-server slice): the ring chunks are those of the whole tensor.
    """
    n_ranks = len(parts)
    ufunc = reduce_op(op)
    if (
        total is None
        and isinstance(parts, np.ndarray)
        and parts.ndim == 2
        and 0 < out.size <= _SMALL_FOLD
        and parts.flags.c_contiguous
    ):
        # the small-message path: a few whole-row numpy calls instead of N per ring chunk
        flat, index = parts.reshape(-1), _fold_index(out.size, n_ranks)
        if n_ranks == 1:
            out[...] = flat
        else:
            ufunc(flat[index[0]], flat[index[1]], out=out)
            for k in range(2, n_ranks):
                ufunc(out, flat[index[k]], out=out)
        if op == "avg":
            finish_avg(out, n_ranks)
        return out
    lo, hi = offset, offset + out.size
    for c, (a, b) in enumerate(ring_chunk_bounds(out.size if total is None else total, n_ranks)):
        a, b = max(a, lo) - lo, min(b, hi) - lo
        if a >= b:
            continue
        acc = out[a:b]
        if n_ranks == 1:
            acc[...] = parts[c][a:b]
            continue
        ufunc(parts[c][a:b], parts[(c + 1) % n_ranks][a:b], out=acc)  # no copy of the first operand first
        for k in range(2, n_ranks):
            ufunc(acc, parts[(c + k) % n_ranks][a:b], out=acc)
    if op == "avg":
        finish_avg(out, n_ranks)
    return out


#: canonical folds of up to this many elements per rank take the gather-index path
_SMALL_FOLD = 1 << 14


@functools.lru_cache(maxsize=64)
def _fold_index(n: int, n_ranks: int) -> np.ndarray:
    """index[k, i]: where, in the flattened (n_ranks, n) rows, the k-th operand of element i lies.

    Element i of ring chunk c folds the ranks c, c+1, ..., c-1 (mod N) in that order.
    """
    chunk = np.empty(n, np.intp)
    for c, (a, b) in enumerate(ring_chunk_bounds(n, n_ranks)):
        chunk[a:b] = c
    rows = (chunk[None, :] + np.arange(n_ranks, dtype=np.intp)[:, None]) % n_ranks
    index = rows * n + np.arange(n, dtype=np.intp)[None, :]
    index.flags.writeable = False
    return index


def farewell(groups: dict[str, Group], stopped_at: dict[str, int]) -> dict[str, Any]:
    """The goodbye a connection layer sends: per group, the first collective this rank did not finish."""
    for gid, group in groups.items():
        stopped_at.setdefault(gid, group.stopped_at())
    return {"seqs": stopped_at}


def finish_avg(acc: np.ndarray, n_ranks: int) -> None:
    np.divide(acc, acc.dtype.type(n_ranks), out=acc)


def check_op(op: str, dtype: np.dtype) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"op={op!r} is not one of {', '.join(REDUCE_OPS)}")
    if op == "avg" and dtype.kind not in "fV" and dtype_name(dtype) != "bfloat16":
        raise TypeError(f"op='avg' needs a floating dtype, got {dtype}; use op='sum' and divide")


class Collective:
    """One in-flight collective on one rank: its descriptor, deadline and outcome."""

    __slots__ = (
        "data_elsewhere",
        "deadline",
        "desc",
        "done",
        "group",
        "input_wait",
        "interrupted",
        "kind",
        "report_grace",
        "seq",
        "started",
        "task",
        "waiting_on",
    )

    def __init__(self, group: Group, seq: int, desc: tuple[Any, ...], timeout: float) -> None:
        self.group = group
        self.seq = seq
        self.desc = desc
        self.kind = desc[0]
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting_on: set[int] = set()  # ranks we still expect frames from
        #: its data comes over links other than the control connections (the ring's data plane),
        #: so a peer's goodbye does not prove that all of the peer's data has arrived
        self.data_elsewhere = False
        #: seconds to wait after the deadline before reporting: another rank knows better who is silent
        self.report_grace = 0.0
        self.task: asyncio.Task[Any] | None = None  # the task running the body
        self.interrupted = False
        #: set when the input is still being copied off a device: wait(a, b) blocks until
        #: elements a:b are in host memory (see Group._input_order)
        self.input_wait: Callable[[int, int], None] | None = None

    @property
    def label(self) -> str:
        return f"{self.kind} #{self.seq}"

    def fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)
            task = self.task
            if task is not None and not self.interrupted:
                self.interrupted = True
                task.cancel()  # Group._run turns this back into exc

    def succeed(self, value: Any = None) -> None:
        if not self.done.done():
            self.done.set_result(value)

    def inspect(self, conn: Connection, header: dict[str, Any]) -> bool:
        """Check a frame of this collective against our own call; False drops it."""
        call = header.get("call")
        if call == self.desc or self.done.done():
            return not self.done.done()
        src = header.get("src", conn.peer.get("rank"))
        err = self.group._mismatch_error(self, src, call)
        self.group._abort_everywhere(self, err, "mismatch")
        return False


_FIELDS = ("kind", "dtype", "shape", "op", "root")


def mismatch_message(seq: int, src: Any, call: Any, rank: Any, desc: tuple[Any, ...]) -> str:
    """Say how rank src's call descriptor for collective #seq differs from rank's own."""
    if not isinstance(call, (list, tuple)) or len(call) != len(_FIELDS):
        return f"rank {src} sent a frame for #{seq} without a valid call descriptor"
    theirs = dict(zip(_FIELDS, call, strict=True))
    mine = dict(zip(_FIELDS, desc, strict=True))
    if theirs["kind"] != mine["kind"]:
        return (
            f"rank {src} called {theirs['kind']} as collective #{seq}, rank {rank} called "
            f"{mine['kind']}: every rank must call the same collectives in the same order"
        )
    diffs = [f for f in _FIELDS[1:] if theirs[f] != mine[f]]
    field = diffs[0] if diffs else "call"
    fix = {
        "dtype": "cast to one dtype on every rank",
        "shape": "pass arrays of one shape on every rank",
        "op": "pass the same op on every rank",
        "root": "pass the same src/dst on every rank",
    }.get(field, "")
    return (
        f"rank {src} sent {field} {_show(theirs.get(field))} for {mine['kind']} #{seq}, "
        f"rank {rank} expected {_show(mine.get(field))}" + (f" ({fix})" if fix else "")
    )


class Group(abc.ABC):
    """A set of ranks running collectives together; ``ring`` and ``ps`` implement it."""

    topology: ClassVar[str] = ""
    registry: ClassVar[dict[str, type[Group]]] = {}

    def __init__(self, rank: int, world_size: int, *, timeout: float, gid: str, mailbox: Mailbox) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.gid = gid
        self.mailbox = mailbox
        self._seq = 0
        self._p2p_sent: dict[int, int] = {}
        self._p2p_recv: dict[int, int] = {}
        self._active: dict[int, Collective] = {}
        self._reserved: set[int] = set()  # numbers taken for collectives not begun yet
        self._aborted: dict[int, PsringError] = {}
        self._broken: PsringError | None = None
        self._departed: dict[int, PeerLostError] = {}  # ranks that closed cleanly
        self._departed_at: dict[int, int | None] = {}  # ... and the first seq they did not finish
        self._closed = False
        self._subgroups = 0
        self._created_at = "".join(traceback.format_stack(limit=8)[:-1])
        self.bytes_sent = 0

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

    # ------------------------------------------------------------------ state
    def _check_usable(self, peer: int | None = None, receiving: bool = False, seq: int | None = None) -> None:
        """Raise if this group cannot run a collective (or, with peer, a send/recv with that rank).

        A rank that left cleanly finished every collective before the one it reported
        in its goodbye, and everything it sent has arrived: slower ranks may still run
        those collectives, and receive what it sent them, without it.
        """
        if self._closed:
            raise GroupClosedError(f"{self!r} is closed")
        if self._broken is not None:
            broken = self._broken
            message = f"{self!r} is broken: {broken}"
            if isinstance(broken, PeerLostError):  # keep who was lost: callers tell servers from workers by it
                raise PeerLostError(message, rank=broken.rank) from broken
            if isinstance(broken, CollectiveTimeoutError):
                raise CollectiveTimeoutError(message, missing=broken.missing) from broken
            raise type(broken)(message) from broken
        if self._departed:
            if peer is None:
                for r, gone in self._departed.items():
                    stopped_at = self._departed_at.get(r)
                    if stopped_at is None or (self._seq if seq is None else seq) >= stopped_at:
                        raise PeerLostError(f"{self!r}: {gone}", rank=gone.rank)
            elif peer in self._departed and not receiving:
                gone = self._departed[peer]
                raise PeerLostError(f"{self!r}: {gone}", rank=gone.rank)

    def stopped_at(self) -> int:
        """The first collective seq this rank has not finished (told to peers when it leaves)."""
        first = min(self._active, default=self._seq)
        return min(first, min(self._reserved)) if self._reserved else first

    def _begin(
        self,
        kind: str,
        x: np.ndarray | None = None,
        op: str | None = None,
        root: int | None = None,
        timeout: float | None = None,
        seq: int | None = None,
    ) -> Collective:
        """Start a collective: the next sequence number, or one reserved earlier (``seq``)."""
        if seq is None:
            self._check_usable()
            seq = self._seq
            self._seq += 1
        else:
            self._reserved.discard(seq)
            self._check_usable(seq=seq)
        dtype = dtype_name(x.dtype) if x is not None else None
        shape = tuple(x.shape) if x is not None else None
        desc = (kind, dtype, shape, op, root)
        coll = Collective(self, seq, desc, self.timeout if timeout is None else timeout)
        pending = self._aborted.pop(seq, None)
        if pending is not None:
            raise pending
        self._active[seq] = coll
        self.mailbox.inspect((self.gid, seq), coll.inspect)
        return coll

    def _end(self, coll: Collective) -> None:
        self._active.pop(coll.seq, None)
        failed = coll.done.cancelled() or coll.done.exception() is not None
        self.mailbox.forget((self.gid, coll.seq), drop_queued=failed)

    async def _run(self, coll: Collective, body: Any) -> Any:
        """Run a collective's body under its deadline; on any failure abandon it cleanly.

        The body runs inline in the caller's task (no task per call: small collectives
        are latency-bound). A failure from elsewhere -- a peer's abort, a mismatch, a lost
        peer, the deadline -- sets ``coll.done`` and cancels this task; the cancellation
        is turned back into that error here.
        """
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        coll.task = task
        timer = loop.call_later(max(coll.deadline - time.monotonic(), 0.0), self._deadline_passed, coll)
        error: BaseException | None = None
        try:
            result = await body
            if coll.interrupted:  # failed from elsewhere after the body's last await
                await _absorb_cancel(task)
                raise _failure(coll)
            return result
        except asyncio.CancelledError as exc:
            if coll.interrupted and task is not None and task.uncancel() == 0:
                error = _failure(coll)
                raise error from None
            error = exc
            raise  # cancelled by the caller too
        except BaseException as exc:
            error = exc
            raise
        finally:
            timer.cancel()
            coll.task = None
            if not coll.done.done():
                coll.done.cancel()
            elif not coll.done.cancelled():
                coll.done.exception()  # mark retrieved
            self._end(coll)
            if OBSERVERS:
                self._observe(coll, error)

    def _observe(self, coll: Collective, failed: BaseException | None) -> None:
        now_wall, now = time.time(), time.monotonic()
        kind, dtype, shape, op, root = coll.desc
        nbytes = 0
        if dtype is not None and shape is not None:
            from .arrays import DTYPES

            nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        settings = getattr(self._layer(), "settings", None)
        record = {
            "job": getattr(settings, "job", None),
            "seq": coll.seq,
            "gid": self.gid,
            "rank": self.rank,
            "world": self.world_size,
            "topology": self.topology,
            "kind": kind,
            "op": op,
            "root": root,
            "dtype": dtype,
            "bytes": nbytes,
            "start": now_wall - (now - coll.started),
            "end": now_wall,
            "ok": failed is None,
            "error": None if failed is None else f"{type(failed).__name__}: {failed}",
        }
        for observer in list(OBSERVERS):
            try:
                observer(record)
            except Exception:  # an observer must never break a collective
                logger.exception("psring observer %r failed", observer)

    def _deadline_passed(self, coll: Collective) -> None:
        if coll.done.done():
            return
        if coll.report_grace > 0:  # let the rank that knows who is silent say so first
            grace, coll.report_grace = coll.report_grace, 0.0
            asyncio.get_running_loop().call_later(grace, self._deadline_passed, coll)
            return
        missing = tuple(sorted(coll.waiting_on))
        who = f"rank(s) {', '.join(map(str, missing))}" if missing else "its peers"
        err = CollectiveTimeoutError(
            f"{coll.label} on rank {self.rank} timed out after {self.timeout:g}s waiting for {who}",
            missing=missing,
        )
        self._abort_everywhere(coll, err, "timeout")

    # --------------------------------------------------------------- failures
    def _mismatch_error(self, coll: Collective, src: Any, call: Any) -> MismatchError:
        return MismatchError(mismatch_message(coll.seq, src, call, self.rank, coll.desc))

    def _abort_everywhere(self, coll: Collective, err: PsringError, reason: str) -> None:
        coll.fail(err)
        self._send_abort(coll.seq, err, reason)

    @abc.abstractmethod
    def _send_abort(self, seq: int, err: PsringError, reason: str) -> None:
        """Tell every peer to abandon collective ``seq`` (topology-specific fan-out)."""

    def on_abort(self, seq: int, reason: str, message: str, missing: Sequence[int] = ()) -> None:
        """A peer abandoned collective ``seq``: fail ours, or remember it for when we get there."""
        err: PsringError
        if reason == "mismatch":
            err = MismatchError(message)
        else:
            err = CollectiveTimeoutError(message, missing=tuple(missing))
        coll = self._active.get(seq)
        if coll is not None:
            coll.fail(err)
        elif seq >= self._seq:
            self._aborted[seq] = err
            if len(self._aborted) > 10_000:  # a runaway peer: keep memory bounded
                self._aborted.pop(min(self._aborted))
        self.mailbox.forget((self.gid, seq), drop_queued=True)

    def on_peer_lost(self, err: PeerLostError) -> None:
        """A peer this group needs is gone: fail everything in flight, refuse new calls."""
        if self._closed:
            return
        if self._broken is None:
            self._broken = err
            log = logger.warning if self._active else logger.debug
            log("%r broken: %s", self, err)
        for coll in list(self._active.values()):
            lost = PeerLostError(f"{err} (while {coll.label} was pending on rank {self.rank})", rank=err.rank)
            lost.__cause__ = err.__cause__
            coll.fail(lost)

    def on_peer_departed(self, local_rank: int, err: PeerLostError, stopped_at: int | None = None) -> bool:
        """A peer closed its connections cleanly (its process is done with the group).

        Everything it sent has arrived by then, so only a collective still waiting for
        its frames fails (returns True: the caller then tells the other ranks); later
        collectives (and send/recv with it) raise at once. A collective whose data comes
        over another link (``data_elsewhere``) that the peer finished (before ``stopped_at``)
        is left to that link: its data may still be on the way, and the link's end says
        whether all of it came.
        """
        if self._closed:
            return False
        self._departed.setdefault(local_rank, err)
        self._departed_at.setdefault(local_rank, stopped_at)
        hurt = False
        for coll in list(self._active.values()):
            if local_rank in coll.waiting_on:
                if coll.data_elsewhere and stopped_at is not None and coll.seq < stopped_at:
                    continue
                lost = PeerLostError(f"{err} (while {coll.label} was pending on rank {self.rank})", rank=err.rank)
                coll.fail(lost)
                hurt = True
        return hurt

    # ---------------------------------------------------------- device staging
    @staticmethod
    def _host(x: Any) -> tuple[np.ndarray, Any]:
        """(host array, the array module results go back to)."""
        x = check_array(x)
        if is_cupy(x):
            return stage_to_host(x), array_module(x)
        return x, np

    @staticmethod
    def _back(y: np.ndarray, xp: Any) -> Any:
        if xp is np:
            return y
        return stage_to_device(y, xp)

    # -------------------------------------------------------- public collectives
    async def all_reduce(self, x: Any, op: str = "sum", compression: str | None = None) -> Any:
        """Reduce x over all ranks with op; every rank gets the result (a new array).

        ``compression="fp16"`` (float32 x, op sum or avg) moves float16 on the wire:
        the ranks first agree on a power-of-two scale (a one-element max all_reduce),
        then fold in float32 in the canonical order; see :mod:`psring.compress`.
        """
        if compression is None and is_cupy(x) and gpu_overlap():
            x = check_array(x)
            order = self._input_order(x.size, x.nbytes) if x.nbytes >= STREAM_MIN_BYTES else None
            if order is not None:
                return await self._all_reduce_streamed(x, op, order)
        host, xp = self._host(x)
        check_op(op, host.dtype)
        if compression is not None:
            check_codec(compression, host.dtype, op)
            amax = np.array([np.max(np.abs(host)) if host.size else 0.0], np.float32)
            agree = self._begin("all_reduce", amax, "max")
            seq = self._seq  # reserved now, so concurrent calls take the same numbers on every rank
            self._seq += 1
            self._reserved.add(seq)
            try:
                amax = await self._run(agree, self._all_reduce(agree, amax, "max"))
            except BaseException:
                self._reserved.discard(seq)
                if self._seq == seq + 1:  # give the number back: ranks that made a plain call never took it
                    self._seq = seq
                raise
            e = scale_exponent(float(amax[0]), self.world_size)
            coll = self._begin("all_reduce", host, codec_op(op, compression, e), seq=seq)
            out = await self._run(coll, self._all_reduce_fp16(coll, host.reshape(-1), op, e))
            return self._back(out.reshape(host.shape), xp)
        coll = self._begin("all_reduce", host, op)
        out = await self._run(coll, self._all_reduce(coll, host.reshape(-1), op))
        return self._back(out.reshape(host.shape), xp)

    async def _all_reduce_streamed(self, x: Any, op: str, order: list[tuple[int, int]]) -> Any:
        """all_reduce of a cupy array whose copy to the host overlaps the network: the
        implementation reads the input range by range in ``order`` (see _input_order)."""
        staged = stage_in_order(x, order)
        try:
            host = staged.host.reshape(x.shape)
            check_op(op, host.dtype)
            coll = self._begin("all_reduce", host, op)
            coll.input_wait = staged.wait
            out = await self._run(coll, self._all_reduce(coll, host.reshape(-1), op))
        finally:
            staged.wait_all()  # no copy may still be writing when the buffer goes back to the pool
        return self._back(out.reshape(x.shape), array_module(x))

    def _input_order(self, count: int, nbytes: int) -> list[tuple[int, int]] | None:
        """The element ranges, in the order this implementation's all_reduce of a tensor this
        size reads its input, when it can start before all of it is in host memory (then it
        calls ``coll.input_wait`` before reading each range); None: it needs it all at once."""
        return None

    async def broadcast(self, x: Any, src: int = 0) -> Any:
        """Every rank gets src's x; other ranks pass an array of the same shape and dtype."""
        self._check_rank(src, "src")
        host, xp = self._host(x)
        coll = self._begin("broadcast", host, None, src)
        out = await self._run(coll, self._broadcast(coll, host.reshape(-1), src))
        return self._back(out.reshape(host.shape), xp)

    async def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        coll = self._begin("barrier")
        await self._run(coll, self._barrier(coll))

    async def all_gather(self, x: Any) -> list[Any]:
        """A list of every rank's x, in rank order."""
        host, xp = self._host(x)
        coll = self._begin("all_gather", host)
        out = await self._run(coll, self._all_gather(coll, host.reshape(-1)))
        return [self._back(out[r].reshape(host.shape), xp) for r in range(self.world_size)]

    async def reduce_scatter(self, x: Any, op: str = "sum") -> Any:
        """This rank's 1/world_size share of the reduction of x.

        The share is ring chunk ``rank`` of the flattened tensor; when ``x.shape[0]``
        divides by world_size that is rows ``rank*k:(rank+1)*k`` and keeps the trailing
        shape, otherwise it is a flat slice. Bits equal the same slice of all_reduce's.
        """
        host, xp = self._host(x)
        check_op(op, host.dtype)
        coll = self._begin("reduce_scatter", host, op)
        flat = await self._run(coll, self._reduce_scatter(coll, host.reshape(-1), op))
        n = self.world_size
        if host.ndim >= 1 and host.shape[0] % n == 0:
            flat = flat.reshape((host.shape[0] // n, *host.shape[1:]))
        return self._back(flat, xp)

    async def reduce(self, x: Any, dst: int = 0, op: str = "sum") -> Any:
        """The reduction on dst (None elsewhere); same bits as all_reduce."""
        self._check_rank(dst, "dst")
        host, xp = self._host(x)
        check_op(op, host.dtype)
        coll = self._begin("reduce", host, op, dst)
        out = await self._run(coll, self._reduce(coll, host.reshape(-1), op, dst))
        return None if out is None else self._back(out.reshape(host.shape), xp)

    async def gather(self, x: Any, dst: int = 0) -> list[Any] | None:
        """A list of every rank's x on dst (None elsewhere)."""
        self._check_rank(dst, "dst")
        host, xp = self._host(x)
        coll = self._begin("gather", host, None, dst)
        out = await self._run(coll, self._gather(coll, host.reshape(-1), dst))
        if out is None:
            return None
        return [self._back(out[r].reshape(host.shape), xp) for r in range(self.world_size)]

    async def scatter(self, xs: Sequence[Any] | None, src: int = 0) -> Any:
        """Rank r gets xs[r] from src; xs is a list of world_size arrays on src, None elsewhere."""
        self._check_rank(src, "src")
        if self.rank == src:
            if xs is None or len(xs) != self.world_size:
                got = "None" if xs is None else f"{len(xs)} arrays"
                raise ValueError(f"scatter on src rank {src} needs a list of {self.world_size} arrays, got {got}")
            staged = [self._host(x) for x in xs]
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
        coll = self._begin("scatter", None, None, src)
        out, (_dtype, shape), dev = await self._run(coll, self._scatter(coll, head[0], src, meta))
        xp = head[1] if head[1] is not None else (cupy_module() if dev == "cuda" else np)
        return self._back(out.reshape(shape), xp)

    async def send(self, x: Any, dst: int) -> None:
        """Send x to rank dst (returns once the bytes left this process)."""
        self._check_rank(dst, "dst")
        if dst == self.rank:
            raise ValueError(f"send: dst={dst} is this rank; use a local copy")
        self._check_usable(peer=dst)
        host, xp = self._host(x)
        n = self._p2p_sent.get(dst, 0)
        self._p2p_sent[dst] = n + 1
        await self._send(host, dst, n, "cuda" if xp is not np else "cpu")

    async def recv(self, src: int, timeout: float | None = None) -> Any:
        """The next array rank src sent to this rank, as the type it was sent as."""
        self._check_rank(src, "src")
        if src == self.rank:
            raise ValueError(f"recv: src={src} is this rank")
        self._check_usable(peer=src, receiving=True)
        n = self._p2p_recv.get(src, 0)
        self._p2p_recv[src] = n + 1
        y, dev = await self._recv(src, n, self.timeout if timeout is None else timeout)
        return self._back(y, cupy_module() if dev == "cuda" and cupy_module() is not None else np)

    async def new_group(self, ranks: Sequence[int]) -> Group | None:
        """A Group over ranks (renumbered 0..k-1); every rank of this group must call it.

        Ranks outside ``ranks`` get a NonMemberGroup whose every call raises a clear error.
        """
        ranks = list(ranks)
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"new_group: ranks {ranks} must be a non-empty list without repeats")
        for r in ranks:
            self._check_rank(r, "ranks[]")
        self._check_usable()
        self._subgroups += 1
        gid = f"{self.gid}.{self._subgroups}"
        if self.rank not in ranks:
            return NonMemberGroup(self.rank, ranks, gid)
        return self._make_subgroup(gid, ranks)

    def _check_rank(self, r: Any, what: str) -> None:
        if type(r) is not int or not 0 <= r < self.world_size:
            raise ValueError(f"{what}={r!r} is not a rank of this group (0..{self.world_size - 1})")

    # --------------------------------------------------------- topology hooks
    @abc.abstractmethod
    async def _all_reduce(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray: ...

    @abc.abstractmethod
    async def _all_reduce_fp16(self, coll: Collective, x: np.ndarray, op: str, e: int) -> np.ndarray:
        """all_reduce of float32 x with float16 on the wire at scale 2**e (see psring.compress)."""

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

    async def _recv(self, src: int, n: int, timeout: float) -> tuple[np.ndarray, str]:
        """The n-th array src sent this rank (whichever way it travelled), and its device."""
        tag = (self.gid, "p2p", src, n)
        fut = self.mailbox.expect(tag)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if fut.done():  # it arrived before anything went wrong: deliver it
                    _conn, hdr, payload = fut.result()
                    break
                self._check_usable(peer=src, receiving=True)
                if src in self._departed:  # it left, and everything it sent has arrived
                    raise PeerLostError(f"recv from rank {src}: {self._departed[src]}", rank=src)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CollectiveTimeoutError(
                        f"recv on rank {self.rank} from rank {src} timed out after {timeout:g}s", missing=(src,)
                    )
                with contextlib.suppress(asyncio.TimeoutError):
                    _conn, hdr, payload = await asyncio.wait_for(asyncio.shield(fut), min(remaining, 0.25))
                    break
        finally:
            self.mailbox.unpost(tag)
            if not fut.done():
                fut.cancel()
        if "dtype" not in hdr:
            raise ProtocolError(f"frame from rank {src} carries no array")
        return wire.decode_tensor(hdr, payload), str(hdr.get("dev", "cpu"))

    @abc.abstractmethod
    def _make_subgroup(self, gid: str, ranks: list[int]) -> Group: ...

    @abc.abstractmethod
    def _layer(self) -> Any:
        """The connection layer under this group (ring: PeerNet; ps: ServerLinks)."""

    async def close(self) -> None:
        """Leave the group: pending calls fail here; peers learn which collectives this rank finished."""
        if self._closed:
            return
        layer = self._layer()
        layer.stopped_at[self.gid] = self.stopped_at()
        self._closed = True
        layer.groups.pop(self.gid, None)
        for coll in list(self._active.values()):
            coll.fail(PeerLostError(f"{self!r} was closed while {coll.label} was pending"))
        if self.gid == "0":
            await asyncio.shield(layer.close())

    def stats(self) -> dict[str, int]:
        """Bytes and frames this rank's connections sent and received."""
        return {"bytes_sent": 0, "bytes_received": 0}


class NonMemberGroup:
    """What new_group returns on ranks outside the subset: every call raises."""

    def __init__(self, rank: int, ranks: list[int], gid: str) -> None:
        self.rank = -1
        self.world_size = len(ranks)
        self.gid = gid
        self._message = f"this process (parent rank {rank}) is not a member of subgroup {gid} over ranks {ranks}"

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


def _failure(coll: Collective) -> BaseException:
    exc = coll.done.exception() if coll.done.done() and not coll.done.cancelled() else None
    return exc or PsringError(f"{coll.label} was abandoned")


async def _absorb_cancel(task: asyncio.Task[Any] | None) -> None:
    """Consume a cancellation requested for this task that no await has delivered yet."""
    try:
        await asyncio.sleep(0)
    except asyncio.CancelledError:
        if task is not None:
            task.uncancel()


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return str(list(value))
    return str(value)


# ------------------------------------------------------------------ staging
def stage_to_host(x: Any) -> np.ndarray:
    """Copy a cupy array to host memory (pinned staging buffers are reused)."""
    from . import gpu

    return gpu.to_host(x)


def stage_in_order(x: Any, order: list[tuple[int, int]]) -> Any:
    """Start copying a cupy array to pinned host memory range by range (gpu.StagedInput)."""
    from . import gpu

    return gpu.StagedInput(x, order)


def stage_to_device(y: np.ndarray, xp: Any) -> Any:
    from . import gpu

    return gpu.to_device(y, xp)


# ---------------------------------------------------------------- init_group
async def init_group(
    topology: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    store: str | None = None,
    secret: str | bytes | None = None,
    timeout: float = 300.0,
    **options: Any,
) -> Group:
    """Join (or form) a group of ``world_size`` ranks over ``topology`` ("ring" or "ps").

    Arguments default from the environment (RANK, WORLD_SIZE, MASTER_ADDR/MASTER_PORT,
    PSRING_TOPOLOGY, PSRING_SECRET); a rank that is not given one gets one from the store.
    """
    from .config import resolve_settings

    settings = resolve_settings(
        topology=topology, rank=rank, world_size=world_size, store=store, secret=secret, timeout=timeout
    )
    # import the implementations so they register themselves
    import importlib

    importlib.import_module(f"psring.{settings.topology}")

    cls = Group.registry[settings.topology]
    group = await cls.create(settings, **options)  # type: ignore[attr-defined]
    if os.environ.get("PSRING_TRACE_DIR"):
        from .observe import process_recorder

        process_recorder(os.environ["PSRING_TRACE_DIR"], settings.job)
    return group  # type: ignore[no-any-return]
