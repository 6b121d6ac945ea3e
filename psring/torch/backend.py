"""psring as a torch.distributed backend: ``dist.init_process_group("psring")``.

``import psring.torch`` registers the backend. An unmodified script then runs over the ring or
the parameter server (``PSRING_TOPOLOGY=ring|ps``, or ``pg_options={"topology": "ps"}``):

    dist.init_process_group("psring")                  # env://, tcp://, file://, torchrun
    model = DistributedDataParallel(model)             # buckets all-reduced by psring

How it fits torch: the backend is a Python ``dist.ProcessGroup`` whose methods (``allreduce``,
``broadcast``, ``all_gather_single``, ``send``, ...) start the psring collective on the group's
event-loop thread and return a :class:`Work` at once. torch's collectives work in place, psring's
return new arrays: when the call finishes, a completion thread (a free one: see _Completer) copies the result
into the caller's tensors and completes the Work's future (so DDP's hooks never run on the event
loop). The world group meets through the c10d store torch hands the backend (torchrun's, a
``tcp://`` or ``file://`` init method's) unless ``PSRING_STORE`` names a psring store (where
running ``psring server`` shards are registered); ``new_group(ranks)`` is a psring subgroup over
the world's links, made by its members only, as torch asks. A ps job hosts its shards in rank 0
(``PSRING_SERVERS`` of them, or one per rank with ``PSRING_PS_COLOCATE``): the ranks are all
the processes it needs.

dtypes: every CPU dtype numpy can view, bool to float64, and complex (as its real pairs: sum and
avg); bfloat16 moves as its 16 bits, and is reduced in float32 then rounded once (gloo rounds at
every step: exact values agree, others may differ in the last bit). AVG of integers is NCCL's:
the sum, then C's integer division by the group's size (truncated toward zero). torch's point-to-point tags
are accepted; messages between two ranks arrive in the order they were sent, whatever the tag.
Errors of a collective (a mismatch, a lost rank, a timeout) complete the Work with
:class:`BackendError`, a ``torch.distributed.DistBackendError`` carrying psring's message (which
names the rank) and the psring error as ``psring_error``.
"""

from __future__ import annotations

import datetime
import math
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..core.arrays import cupy_module
from ..core.sparse import SparseRows
from ..errors import CollectiveTimeoutError, PsringError
from ..rendezvous.torchstore import TorchStoreClient
from ..settings import current as current_settings
from ..topology.blocking import BlockingGroup, init
from ..topology.now import Done

NAME = "psring"

_REDUCE_OPS: dict[Any, str] = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.PRODUCT: "prod",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
}


class BackendError(dist.DistBackendError):
    """A psring collective failed under torch.distributed; ``psring_error`` is psring's own error."""

    def __init__(self, message: str, psring_error: BaseException | None = None) -> None:
        super().__init__(message)
        self.psring_error = psring_error


def _as_torch_error(exc: BaseException) -> BaseException:
    if isinstance(exc, dist.DistError):
        return exc
    if isinstance(exc, PsringError):
        # torch's own backends say "Timed out" where a call ran past its timeout: so does this one
        said = "Timed out -- " if isinstance(exc, CollectiveTimeoutError) else ""
        err = BackendError(f"psring {type(exc).__name__}: {said}{exc}", exc)
        err.__cause__ = exc
        return err
    return exc  # bad arguments and the like keep their own type (ValueError, TypeError)


# ------------------------------------------------------------------ tensors
def _view(t: torch.Tensor) -> Any:
    """A numpy (CPU) or cupy (CUDA) array sharing contiguous tensor ``t``'s memory."""
    if t.device.type == "cpu":
        return np.from_dlpack(t.detach())
    if t.device.type == "cuda":
        cp = cupy_module()
        if cp is None:
            raise RuntimeError("a CUDA tensor needs cupy to travel through psring (pip install psring[gpu])")
        return cp.from_dlpack(t.detach())
    raise TypeError(f"psring: tensors on {t.device} are not supported (cpu or cuda)")


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor whose bits psring can move unchanged (bfloat16 as int16, complex as pairs)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj())
    return t


def _reducible(t: torch.Tensor, op: str) -> tuple[torch.Tensor, bool]:
    """``t`` in a dtype psring reduces (bfloat16 in float32), and whether that is a copy."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.float(), True
    if t.is_complex():
        if op not in ("sum", "avg"):
            raise ValueError(f"psring: {op} of complex tensors is not defined (sum and avg are)")
        return torch.view_as_real(t.resolve_conj()), False
    return (t, False) if t.is_contiguous() else (t.contiguous(), True)


def _from(a: Any) -> torch.Tensor:
    if isinstance(a, np.ndarray) and not a.flags.writeable:
        a = a.copy()
    return torch.from_dlpack(a)


def _store_into(dst: torch.Tensor, a: Any) -> None:
    """Copy psring's result ``a`` into tensor ``dst`` (the dtype and layout torch asked for)."""
    src = _from(a)
    if dst.dtype == torch.bfloat16 and src.dtype == torch.int16:
        src = src.view(torch.bfloat16)
    elif dst.is_complex() and not src.is_complex():
        src = torch.view_as_complex(src.reshape(*dst.shape, 2).contiguous())
    if src.numel() != dst.numel():
        raise BackendError(
            f"psring: received {src.numel()} elements for a tensor of {dst.numel()} ({tuple(dst.shape)}): "
            "the sender's tensor and this one differ in size"
        )
    with torch.no_grad():
        dst.copy_(src.reshape(dst.shape))


def _reduce_op(opts: Any) -> str:
    op = opts.reduceOp
    for known, name in _REDUCE_OPS.items():
        if op == known:
            return name
    name = str(getattr(op, "op", op)).rsplit(".", 1)[-1]
    raise ValueError(f"psring: reduce op {name} is not supported (SUM, AVG, PRODUCT, MIN, MAX)")


def _integer_avg(op: str, dtype: torch.dtype, size: int) -> tuple[str, Callable[[Any], Any]]:
    """AVG of integers, as NCCL does it (its SumPostDiv): the sum over the group, then each element
    divided by the group's size in C's integer division -- truncated toward zero (-7 / 2 = -3).
    Frameworks rely on it (Lightning averages an int64 batch count with AVG for every backend but
    gloo). Returns the op psring runs and what to apply to its result."""
    if op != "avg" or dtype.is_floating_point or dtype.is_complex:
        return op, lambda a: a
    if dtype == torch.bool:
        raise ValueError("psring: AVG of bool tensors is not defined (SUM, MIN, MAX and PRODUCT are)")

    def divide(a: Any) -> np.ndarray:
        a = np.asarray(a)
        out = np.empty_like(a)  # an array even for a 0-d result (numpy's scalar arithmetic gives scalars)
        np.floor_divide(np.abs(a), size, out=out)
        np.multiply(out, np.sign(a), out=out)
        return out

    return "sum", divide


def _one(tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"psring: {what} takes one tensor per process, got {len(tensors)}")
    return tensors[0]


# ---------------------------------------------------------------- the Work
class Work(dist._Work):
    """A started psring call: ``wait()``, ``is_completed()``, ``get_future()``, ``exception()``.

    Two futures: psring completes ``_done`` (its value the output tensors, or the error), and
    ``get_future()`` hands torch a future chained on it. A Python future can only hold an error as
    a value that raises when Python unwraps it; C++ callers (DDP's reducer) would read that value as
    tensors. Raising in the chained callback gives the future they see a real error instead,
    which DDP raises from ``backward()`` as a RuntimeError carrying psring's message. ``wait()``
    raises the :class:`BackendError` itself.
    """

    def __init__(self, done: torch.futures.Future) -> None:
        super().__init__()
        self._done = done
        self._future = done.then(_unwrap)
        self.sender: dict[str, int] | None = None  # a receive from any source: its sender, once done

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._done.wait()  # raises the collective's error
        self._future.wait()  # and returns once the callbacks chained on it ran
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def _source_rank(self) -> int:
        """The sender of a receive from any source (dist.recv(src=None) asks this after wait)."""
        if self.sender is None:
            raise RuntimeError("psring: _source_rank() is only defined for a receive from any source")
        self.wait()
        return int(self.sender["rank"])

    def is_completed(self) -> bool:
        return bool(self._done.done())

    def is_success(self) -> bool:
        return self.exception() is None

    def exception(self) -> BaseException | None:
        if not self._done.done():
            return None
        try:
            self._done.value()
        except BaseException as exc:  # torch's Work reports any failure as a value
            return exc
        return None

    def result(self) -> Any:
        return self._done.value()

    def synchronize(self) -> None:
        pass


def _unwrap(done: torch.futures.Future) -> Any:
    return done.value()  # raises the error, which marks the chained future failed


class _Completer:
    """The threads that finish Works: copy results into tensors, complete futures.

    psring completes its calls on the event-loop thread; the copying, and the callbacks torch
    chains on a Work's future (DDP's gradient division, a comm hook's next step), run here instead.
    A callback is the user's code and may block: torch's PowerSGD hook waits, inside its ``then``,
    on an all_reduce it has just started, and that all_reduce is completed here too. So every
    completion is handed to a thread that is free: one that waits on the queue, or a new one when
    all are busy -- a blocked callback keeps its own thread and holds up nothing else. One thread
    serves while callbacks return promptly (completions then run in the order the calls ended);
    the extra threads end after ``IDLE`` seconds without work.
    """

    IDLE = 10.0

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._free = 0  # threads waiting on the queue that no queued item has claimed
        self._threads = 0
        self._started = 0  # threads started so far (names them)

    def put(self, item: Any) -> None:
        with self._lock:
            # each item claims a free thread or starts one: the queue never holds an item that
            # only a busy thread could take
            self._queue.put(item)
            if self._free:
                self._free -= 1
                return
            self._threads += 1
            self._started += 1
            first = self._threads == 1
            name = f"psring-torch-done-{self._started}"
        threading.Thread(target=self._run, args=(first,), name=name, daemon=True).start()

    @property
    def threads(self) -> int:
        """How many completion threads there are now (one, unless a callback blocked one)."""
        return self._threads

    def _run(self, first: bool) -> None:
        while True:
            try:
                cf, finish, future = self._queue.get(timeout=None if first else self.IDLE)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty() and self._free > 0:  # unclaimed: this thread may go
                        self._free -= 1
                        self._threads -= 1
                        return
                continue
            try:
                value = finish(cf.result())
            except BaseException as exc:  # torch's Future carries any failure
                future.set_exception(_as_torch_error(exc))
            else:
                future.set_result(value)  # the callbacks chained on it run here
            del cf, finish, future
            with self._lock:
                self._free += 1


_completer = _Completer()


# ----------------------------------------------------------- the ProcessGroup
class ProcessGroupPsring(dist.ProcessGroup):
    """A torch ProcessGroup over a psring group (ring or ps); made by ``init_process_group("psring")``."""

    def __init__(self, group: BlockingGroup, rank: int, size: int, *, world: bool) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the Python ProcessGroup's (rank, size) form
        self.psring_group = group
        self._world = world
        self._closed = False
        #: calls submitted to the loop and not ended there: while there are any, every call takes the loop
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        # the device types this group serves, as torch reads them (``pg._device_types``: DCP's
        # async_save and broadcast-from-rank-0 loading ask for cpu). A Python group has no C++
        # backend to register: torch keeps the device type, and every call still comes here.
        for device in _devices():
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, None)

    # ------------------------------------------------------------ plumbing
    def getBackendName(self) -> str:
        return NAME

    # torch names each group after making it and reads the name back (destroy_process_group, the
    # group registry); a ProcessGroup keeps its name in its backends, and this one has none
    def _set_group_name(self, name: str) -> None:
        self._psring_name = name

    @property
    def group_name(self) -> str:
        name = getattr(self, "_psring_name", None)
        if name is None:
            raise RuntimeError("ProcessGroup name not set")
        return name

    def _set_group_desc(self, desc: str) -> None:
        self._psring_desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_psring_desc", "undefined")

    def __repr__(self) -> str:
        return f"ProcessGroupPsring(rank={self.rank()}, size={self.size()}, {self.psring_group!r})"

    def _start(self, coro: Any, finish: Callable[[Any], Any]) -> Work:
        """Run ``coro`` (one psring call) on the loop; a Work now, the tensors filled by ``finish``.
        Calls begin in the order they are made, so every rank numbers their collectives alike."""
        if self._closed:
            raise BackendError("psring: this process group was shut down (destroy_process_group)")
        future: torch.futures.Future = torch.futures.Future()
        with self._inflight_lock:
            self._inflight += 1
        cf = self.psring_group.portal.submit(coro)
        cf.add_done_callback(lambda cf: self._ended(cf, finish, future))
        return Work(future)

    def _ended(self, cf: Any, finish: Callable[[Any], Any], future: torch.futures.Future) -> None:
        with self._inflight_lock:
            self._inflight -= 1
        _completer.put((cf, finish, future))

    def _all_reduce(self, x: np.ndarray, op: str, finish: Callable[[Any], Any]) -> Work:
        """all_reduce of x; on the calling thread when the group offers its short way for it and
        nothing is in flight (the ring's same-host board: no hop to the event loop, none back)."""
        if self._inflight or self._closed:
            return self._start(self._g.all_reduce(x, op), finish)
        future: torch.futures.Future = torch.futures.Future()
        try:
            now = self._g.try_now(x, op, holds_caller=False)  # a plane job stays off this thread: DDP overlaps it
            if not isinstance(now, Done):  # not a short way's call, or a late peer: the loop runs (the rest of) it
                return self._start(now.rest if now is not None else self._g.all_reduce(x, op), finish)
            future.set_result(finish(now.value))
        except BaseException as exc:  # torch's Future carries any failure
            future.set_exception(_as_torch_error(exc))
        return Work(future)

    @property
    def _g(self) -> Any:
        return self.psring_group.group

    # --------------------------------------------------------- collectives
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.AllreduceOptions()
        op = _reduce_op(opts)
        if len(tensors) != 1:
            return self.allreduce_coalesced(tensors, opts)
        t = tensors[0]
        if t.is_sparse:
            return self._sparse_allreduce(t, op, tensors)
        op, post = _integer_avg(op, t.dtype, self.size())
        x, _ = _reducible(t, op)

        def finish(out: Any) -> list[torch.Tensor]:
            _store_into(t if not t.is_complex() else torch.view_as_real(t), post(out))
            return tensors

        return self._all_reduce(_view(x), op, finish)

    def _sparse_allreduce(self, t: torch.Tensor, op: str, tensors: list[torch.Tensor]) -> Work:
        """SUM of a sparse COO tensor: its sparse coordinates flattened to one row index, the dense
        rest to a row, and ``sparse_all_reduce`` (each index's rows added in rank order, one call
        whose collectives are numbered at once); the result replaces ``t``."""
        if op != "sum":
            raise ValueError(f"psring: all_reduce of a sparse tensor supports SUM only, got {op.upper()}")
        if t.is_complex():
            raise ValueError("psring: all_reduce of a sparse complex tensor is not supported")
        c = t.detach().coalesce()
        lead, rest = tuple(c.shape[: c.sparse_dim()]), tuple(c.shape[c.sparse_dim() :])
        values = c.values().contiguous()
        if values.dtype == torch.bfloat16:
            values = values.float()  # summed in float32, rounded once (as the dense path)
        nnz = values.shape[0]
        flat = np.ravel_multi_index(tuple(c.indices().numpy()), lead) if nnz else np.empty(0, np.int64)
        rows = SparseRows(flat, _view(values).reshape(nnz, math.prod(rest)), max(math.prod(lead), 1))

        def finish(out: SparseRows) -> list[torch.Tensor]:
            index = torch.from_numpy(np.stack(np.unravel_index(out.indices, lead)).astype(np.int64))
            summed = _from(np.ascontiguousarray(out.values)).reshape(len(out.indices), *rest)
            merged = torch.sparse_coo_tensor(index, summed, c.shape)
            with torch.no_grad():
                t.copy_(merged.coalesce().to(t.dtype))
            return tensors

        return self._start(self._g.sparse_all_reduce(rows), finish)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        op = _reduce_op(opts if opts is not None else dist.AllreduceCoalescedOptions())
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1:
            raise ValueError(f"psring: allreduce_coalesced needs tensors of one dtype, got {sorted(map(str, dtypes))}")
        op, post = _integer_avg(op, tensors[0].dtype, self.size()) if tensors else (op, lambda a: a)
        flat = torch.cat([_reducible(t, op)[0].reshape(-1) for t in tensors])

        def finish(out: Any) -> list[torch.Tensor]:
            res, off = _from(post(out)), 0
            for t in tensors:
                view = torch.view_as_real(t) if t.is_complex() else t
                with torch.no_grad():
                    view.copy_(res[off : off + view.numel()].reshape(view.shape))
                off += view.numel()
            return tensors

        return self._all_reduce(_view(flat), op, finish)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.BroadcastOptions()
        t = _one(tensors, "broadcast")
        root = int(opts.rootRank)

        def finish(out: Any) -> list[torch.Tensor]:
            if self.rank() != root:
                _store_into(t, out)
            return tensors

        return self._start(self._g.broadcast(_view(_wire(t)), root), finish)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.ReduceOptions()
        t = _one(tensors, "reduce")
        op, root = _reduce_op(opts), int(opts.rootRank)
        op, post = _integer_avg(op, t.dtype, self.size())
        x, _ = _reducible(t, op)

        def finish(out: Any) -> list[torch.Tensor]:
            if out is not None:
                _store_into(t if not t.is_complex() else torch.view_as_real(t), post(out))
            return tensors

        return self._start(self._g.reduce(_view(x), root, op), finish)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Work:
        t = _one(inputs, "allgather")
        outs: Any = _one(outputs, "allgather")  # type: ignore[arg-type]  # the list of one rank's outputs
        self._check_list(outs, "all_gather's tensor_list")

        def finish(parts: list[Any]) -> list[list[torch.Tensor]]:
            for dst, part in zip(outs, parts, strict=True):
                _store_into(dst, part)
            return outputs

        return self._start(self._g.all_gather(_view(_wire(t))), finish)

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        """dist.all_gather_coalesced: every rank's list of tensors (any shapes, one dtype), in one
        all_gather of their concatenation."""
        self._check_list(outputs, "all_gather_coalesced's output_tensor_lists")
        for r, outs in enumerate(outputs):
            if [o.numel() for o in outs] != [t.numel() for t in inputs]:
                raise ValueError(
                    f"psring: all_gather_coalesced's output_tensor_lists[{r}] holds {[o.numel() for o in outs]} "
                    f"elements per tensor, the inputs {[t.numel() for t in inputs]}"
                )
        flat = torch.cat([_wire(t).reshape(-1) for t in inputs]) if inputs else torch.empty(0)

        def finish(parts: list[Any]) -> list[list[torch.Tensor]]:
            for outs, part in zip(outputs, parts, strict=True):
                got, off = np.asarray(part).reshape(-1), 0
                for o in outs:
                    _store_into(o, got[off : off + o.numel()])
                    off += o.numel()
            return outputs

        return self._start(self._g.all_gather(_view(flat)), finish)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        n = input.numel()
        if output.numel() != n * self.size():
            raise ValueError(
                f"psring: all_gather_into_tensor needs an output of {self.size()} x {n} elements, got {output.numel()}"
            )

        def finish(parts: list[Any]) -> list[torch.Tensor]:
            flat = output.view(-1) if output.is_contiguous() else None
            for r, part in enumerate(parts):
                if flat is not None:
                    _store_into(flat[r * n : (r + 1) * n], part)
                else:
                    _store_into(output.reshape(self.size(), n)[r], part)
            return [output]

        return self._start(self._g.all_gather(_view(_wire(input))), finish)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        """all_gather_into_tensor of several tensors at once (torch's functional collectives,
        DTensor and FSDP2 call it): one all_gather of the inputs' bytes, each output rank-major."""
        if len(outputs) != len(inputs):
            raise ValueError(
                f"psring: all_gather_into_tensor_coalesced has {len(outputs)} outputs for {len(inputs)} inputs"
            )
        for i, (o, t) in enumerate(zip(outputs, inputs, strict=True)):
            if o.numel() != t.numel() * self.size() or o.dtype != t.dtype or not o.is_contiguous():
                raise ValueError(
                    f"psring: all_gather_into_tensor_coalesced's output {i} needs {self.size()} x {t.numel()} "
                    f"{t.dtype} elements, contiguous; got {o.numel()} {o.dtype}"
                    + ("" if o.is_contiguous() else ", not contiguous")
                )
        raw = [_wire(t).reshape(-1).view(torch.uint8) for t in inputs]
        flat = torch.cat(raw) if raw else torch.empty(0, dtype=torch.uint8)

        def finish(parts: list[Any]) -> list[torch.Tensor]:
            for r, part in enumerate(parts):
                got, off = _from(part).reshape(-1), 0
                for o, b in zip(outputs, raw, strict=True):
                    piece, off = got[off : off + b.numel()], off + b.numel()
                    wire = _wire(o).dtype
                    if piece.storage_offset() % wire.itemsize:
                        piece = piece.clone()  # an earlier input's odd size: align before the view
                    k = o.numel() // self.size()
                    _store_into(o.view(-1)[r * k : (r + 1) * k], piece.view(wire))
            return outputs

        return self._start(self._g.all_gather(_view(flat)), finish)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.GatherOptions()
        t, root = _one(inputs, "gather"), int(opts.rootRank)
        if self.rank() == root:
            self._check_list(_one(outputs, "gather"), "gather's gather_list")  # type: ignore[arg-type]

        def finish(parts: list[Any] | None) -> list[list[torch.Tensor]]:
            if parts is not None:
                for dst, part in zip(outputs[0], parts, strict=True):
                    _store_into(dst, part)
            return outputs

        return self._start(self._g.gather(_view(_wire(t)), root), finish)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.ScatterOptions()
        t, root = _one(outputs, "scatter"), int(opts.rootRank)
        xs = None
        if self.rank() == root:
            parts = _one(inputs, "scatter")  # type: ignore[arg-type]
            self._check_list(parts, "scatter's scatter_list")  # type: ignore[arg-type]
            xs = [_view(_wire(p)) for p in parts]

        def finish(out: Any) -> list[torch.Tensor]:
            _store_into(t, out)
            return outputs

        return self._start(self._g.scatter(xs, root), finish)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        t, parts = _one(outputs, "reduce_scatter"), _one(inputs, "reduce_scatter")  # type: ignore[arg-type]
        self._check_list(parts, "reduce_scatter's input_list")  # type: ignore[arg-type]
        for i, p in enumerate(parts):
            if p.numel() != t.numel() or p.dtype != t.dtype:
                raise ValueError(
                    f"psring: reduce_scatter's input_list[{i}] has {p.numel()} {p.dtype} elements, "
                    f"the output {t.numel()} {t.dtype} (every part must match the output)"
                )
        op, post = _integer_avg(_reduce_op(opts), t.dtype, self.size())
        flat = torch.cat([_reducible(p, op)[0].reshape(-1) for p in parts])

        def finish(out: Any) -> list[torch.Tensor]:
            _store_into(t if not t.is_complex() else torch.view_as_real(t), post(out))
            return outputs

        return self._start(self._g.reduce_scatter(_view(flat), op), finish)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if input.numel() != output.numel() * self.size():
            raise ValueError(
                f"psring: reduce_scatter_tensor needs an input of {self.size()} x {output.numel()} elements, "
                f"got {input.numel()}"
            )
        op, post = _integer_avg(_reduce_op(opts), input.dtype, self.size())
        x, _ = _reducible(input, op)

        def finish(out: Any) -> list[torch.Tensor]:
            _store_into(output if not output.is_complex() else torch.view_as_real(output), post(out))
            return [output]

        return self._start(self._g.reduce_scatter(_view(x.reshape(-1)), op), finish)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        """reduce_scatter_tensor of several tensors at once (torch's functional collectives): one
        reduce_scatter whose rank-r block holds every input's r-th part, so each output is what
        reduce_scatter_tensor of its input alone gives."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        n = self.size()
        if len(outputs) != len(inputs):
            raise ValueError(
                f"psring: reduce_scatter_tensor_coalesced has {len(outputs)} outputs for {len(inputs)} inputs"
            )
        dtypes = {t.dtype for t in inputs}
        if len(dtypes) > 1:
            raise ValueError(
                f"psring: reduce_scatter_tensor_coalesced needs inputs of one dtype, got {sorted(map(str, dtypes))}"
            )
        for i, (o, t) in enumerate(zip(outputs, inputs, strict=True)):
            if t.numel() != o.numel() * n or o.dtype != t.dtype:
                raise ValueError(
                    f"psring: reduce_scatter_tensor_coalesced's input {i} needs {n} x {o.numel()} {o.dtype} "
                    f"elements, got {t.numel()} {t.dtype}"
                )
        if not inputs:
            return self.barrier()
        op, post = _integer_avg(_reduce_op(opts), inputs[0].dtype, n)
        blocks = [_reducible(t, op)[0].reshape(n, -1) for t in inputs]
        flat = torch.cat(blocks, dim=1).reshape(-1)

        def finish(out: Any) -> list[torch.Tensor]:
            got, off = _from(post(out)).reshape(-1), 0
            for o in outputs:
                view = torch.view_as_real(o) if o.is_complex() else o
                k = view.numel()
                _store_into(view, got[off : off + k])
                off += k
            return outputs

        return self._start(self._g.reduce_scatter(_view(flat), op), finish)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        opts: Any = None,
    ) -> Work:
        ins = self._splits(input, input_splits, "input")
        outs = self._splits(output, output_splits, "output")
        return self._all_to_all(outs, ins, [output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Work:
        self._check_list(outputs, "all_to_all's output_tensor_list")
        self._check_list(inputs, "all_to_all's input_tensor_list")
        return self._all_to_all(outputs, inputs, outputs)

    def _all_to_all(self, outs: list[torch.Tensor], ins: list[torch.Tensor], result: list[torch.Tensor]) -> Work:
        g, me = self._g, self.rank()
        arrays = [_view(_wire(x)) for x in ins]

        async def exchange() -> list[Any]:
            import asyncio

            # every send and recv starts now, in rank order: the same order on every rank
            sends = [asyncio.ensure_future(g.send(arrays[r], r)) for r in range(self.size()) if r != me]
            recvs = {r: asyncio.ensure_future(g.recv(r)) for r in range(self.size()) if r != me}
            await asyncio.gather(*sends, *recvs.values())
            return [arrays[r] if r == me else recvs[r].result() for r in range(self.size())]

        def finish(parts: list[Any]) -> list[torch.Tensor]:
            for dst, part in zip(outs, parts, strict=True):
                _store_into(dst, part)
            return result

        return self._start(exchange(), finish)

    def _splits(self, t: torch.Tensor, splits: list[int], what: str) -> list[torch.Tensor]:
        n = self.size()
        if not splits:
            if t.shape[0] % n:
                raise ValueError(f"psring: all_to_all_single's {what} has {t.shape[0]} rows, not divisible by {n}")
            splits = [t.shape[0] // n] * n
        if len(splits) != n or sum(splits) != t.shape[0]:
            raise ValueError(
                f"psring: all_to_all_single's {what}_split_sizes {splits} must be {n} sizes summing to {t.shape[0]}"
            )
        return list(torch.split(t, list(splits)))

    def barrier(self, opts: Any = None) -> Work:
        return self._start(self._g.barrier(), lambda _: [])

    # ---------------------------------------------------------- point to point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Work:
        t = _one(tensors, "send")
        return self._start(self._g.send(_view(_wire(t)), dst), lambda _: tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Work:
        t = _one(tensors, "recv")

        def finish(out: Any) -> list[torch.Tensor]:
            _store_into(t, out)
            return tensors

        return self._start(self._g.recv(src), finish)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Work:
        """The next tensor any rank sends this one (``dist.recv(t)`` with no src); the Work's
        ``_source_rank()`` names the sender."""
        t = _one(tensors, "recv")
        sender: dict[str, int] = {}

        def finish(out: Any) -> list[torch.Tensor]:
            sender["rank"], array = out
            _store_into(t, array)
            return tensors

        work = self._start(self._g.recv_any(), finish)
        work.sender = sender  # read by _source_rank once the receive is done
        return work

    # ------------------------------------------------------------- helpers
    def _check_list(self, xs: Sequence[Any], what: str) -> None:
        if len(xs) != self.size():
            raise ValueError(f"psring: {what} has {len(xs)} tensors, the group has {self.size()} ranks")

    def closed_with_world(self) -> None:
        """The world group was shut down: this subgroup is closed with it (its group went with the world's)."""
        self._closed = True

    def shutdown(self) -> None:
        """Leave the psring group (destroy_process_group calls this)."""
        if self._closed:
            return
        self._closed = True
        _groups.pop(id(self), None)
        if self._world:
            _state.world = None
            for sub in list(_groups.values()):
                sub.closed_with_world()
            _groups.clear()
            self.psring_group.close()
        else:
            portal = self.psring_group.portal
            if not portal.loop.is_closed():
                portal.call(self._g.close(), timeout=10)

    def abort(self) -> None:
        self.shutdown()


class _State:
    world: ProcessGroupPsring | None = None


_state = _State()
_groups: dict[int, ProcessGroupPsring] = {}


# ---------------------------------------------------------------- the creator
def _store_address(store: Any) -> str:
    """Where torch's store is, as psring's address (for the address the ranks advertise)."""
    s = store
    while isinstance(s, dist.PrefixStore):
        s = s.underlying_store
    host = getattr(s, "host", None)
    port = getattr(s, "port", None)
    if host and port:
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"torch://{host}:{port}"
    path = getattr(s, "path", None) or "/"
    return f"file://{path}"  # a FileStore: the ranks may be on hosts sharing its directory


def _options(pg_options: Any) -> dict[str, Any]:
    if pg_options is None:
        return {}
    if isinstance(pg_options, dict):
        opts = dict(pg_options)
    elif hasattr(pg_options, "_timeout") and hasattr(pg_options, "backend"):  # a c10d Backend.Options
        named = str(pg_options.backend or "")
        if named.lower() not in ("", NAME) or hasattr(pg_options, "_threads"):
            raise ValueError(
                f"psring backend: pg_options {type(pg_options).__qualname__} for backend {named or 'gloo'!r} are "
                "another backend's; psring takes a dict of topology, servers, colocate"
            )
        return {}  # psring's own c10d options: their timeout reached the backend already
    else:
        opts = {k: getattr(pg_options, k) for k in ("topology", "servers", "colocate") if hasattr(pg_options, k)}
    unknown = sorted(set(opts) - {"topology", "servers", "colocate"})
    if unknown:
        raise ValueError(f"psring backend: unknown pg_options {unknown} (topology, servers, colocate)")
    return opts


def create(backend_opts: Any, pg_options: Any = None) -> ProcessGroupPsring:
    """torch's backend creator (extended API): the world group first, subgroups over its links."""
    rank, size = int(backend_opts.group_rank), int(backend_opts.group_size)
    timeout = backend_opts.timeout.total_seconds() if backend_opts.timeout else 1800.0
    world = _state.world
    if world is None or not dist.is_initialized():
        opts = _options(pg_options)
        settings = current_settings()
        store: Any
        if settings.store:  # a psring store (where running `psring server` shards registered)
            store = settings.store
        else:
            store = TorchStoreClient(backend_opts.store, _store_address(backend_opts.store))
        group = init(
            topology=opts.pop("topology", None),
            rank=rank,
            world_size=size,
            store=store,
            timeout=timeout,
            **opts,
        )
        pg = ProcessGroupPsring(group, rank, size, world=True)
        _state.world = pg
        return pg
    if pg_options is not None:
        raise ValueError("psring backend: pg_options are taken by init_process_group only (new_group uses the world's)")
    ranks = [int(r) for r in backend_opts.global_ranks_in_group] or list(range(size))
    bg = world.psring_group

    async def make() -> Any:
        sub = bg.group.make_subgroup(f"{bg.group.gid}.t{backend_opts.group_id}", ranks)
        sub.timeout = timeout  # new_group(timeout=...): the subgroup's own, not the world's
        return sub

    sub = BlockingGroup(bg.portal.call(make()), bg.portal, owns_portal=False)
    pg = ProcessGroupPsring(sub, rank, size, world=False)
    _groups[id(pg)] = pg
    return pg


def _devices() -> list[str]:
    """The device types psring serves: cpu, and cuda where cupy is (CUDA tensors go through it)."""
    return ["cpu", "cuda"] if cupy_module() is not None else ["cpu"]


def register() -> None:
    """Register the backend "psring" with torch.distributed (done by ``import psring.torch``)."""
    if NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(NAME, create, extended_api=True, devices=_devices())


__all__ = ["BackendError", "ProcessGroupPsring", "Work", "create", "register"]
