"""psring under an existing PyTorch training loop, the way Horovod's DistributedOptimizer works.

torch is never a dependency of psring: import this module only where torch is installed.

    import psring, psring.torch as pt
    group = psring.init()                                  # the blocking facade
    pt.broadcast_parameters(model, group)                  # every rank starts from rank 0's weights
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), group)
    pt.broadcast_optimizer_state(opt, group)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()                    # buckets are averaged while backward runs
        opt.step()                                         # waits for the averages, then steps

Tensors cross into psring without copies (DLPack: numpy for CPU tensors, cupy for CUDA ones).
Collectives here return new tensors (psring's rule: inputs are never modified);
DistributedOptimizer writes the averaged gradients into ``.grad`` in place.

Importing this module also registers psring as a torch.distributed backend (``backend``:
``dist.init_process_group("psring")``).
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..core.arrays import cupy_module
from ..core.codec import codec_named
from ..core.sparse import SparseRows
from ..topology.blocking import BlockingGroup, Handle

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("psring.torch needs PyTorch (pip install torch); psring itself does not") from exc


#: gradient bucket size, as DDP's default
BUCKET_BYTES = 25 << 20


from . import backend as backend  # noqa: E402 - torch must import first
from .backend import BackendError, ProcessGroupPsring, register  # noqa: E402

register()  # dist.init_process_group("psring") from now on; ``register`` is also a setup hook for
# processes that frameworks start (Ray: runtime_env={"worker_process_setup_hook": "psring.torch.register"})


# ------------------------------------------------------------------ tensors
def to_array(t: torch.Tensor) -> Any:
    """A numpy (CPU) or cupy (CUDA) array sharing ``t``'s memory (DLPack, no copy)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    t = t.detach()
    if t.dtype == torch.bfloat16:
        raise TypeError("bfloat16 tensors have no numpy dtype: cast to float32 first")
    if t.device.type == "cpu":
        return np.from_dlpack(t.resolve_conj().resolve_neg())
    if t.device.type == "cuda":
        cp = cupy_module()
        if cp is None:
            raise RuntimeError("a CUDA tensor needs cupy to travel through psring (pip install psring[gpu])")
        return cp.from_dlpack(t)
    raise TypeError(f"tensors on {t.device} are not supported (cpu or cuda)")


def from_array(a: Any) -> torch.Tensor:
    """A torch tensor sharing array ``a``'s memory (DLPack, no copy)."""
    if isinstance(a, np.ndarray) and not a.flags.writeable:
        a = a.copy()
    return torch.from_dlpack(a)


def _blocking(group: Any) -> BlockingGroup:
    if not isinstance(group, BlockingGroup):
        raise TypeError(
            "psring.torch works with the blocking facade: pass group = psring.init(...), "
            f"not {type(group).__name__} (an async Group: convert with to_array/from_array yourself)"
        )
    return group


class _TensorHandle:
    """An async_op handle whose result comes back as torch tensors."""

    def __init__(self, handle: Handle, convert: Any) -> None:
        self._handle, self._convert = handle, convert

    def wait(self, timeout: float | None = None) -> Any:
        return self._convert(self._handle.wait(timeout))

    def done(self) -> bool:
        return self._handle.done()

    def exception(self) -> BaseException | None:
        return self._handle.exception()


def _call(group: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], async_op: bool, convert: Any) -> Any:
    g = _blocking(group)
    out = getattr(g, name)(*args, async_op=async_op, **kwargs)
    return _TensorHandle(out, convert) if async_op else convert(out)


def _tensor(a: Any) -> Any:
    return None if a is None else from_array(a)


def _tensors(xs: Any) -> Any:
    return None if xs is None else [from_array(a) for a in xs]


def all_reduce(
    group: Any, tensor: torch.Tensor, op: str = "sum", *, compression: str | None = None, async_op: bool = False
) -> Any:
    """A new tensor: ``tensor`` reduced over the group (op sum, avg, min, max, prod)."""
    return _call(group, "all_reduce", (to_array(tensor), op), {"compression": compression}, async_op, _tensor)


def broadcast(group: Any, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Any:
    return _call(group, "broadcast", (to_array(tensor), src), {}, async_op, _tensor)


def all_gather(group: Any, tensor: torch.Tensor, *, async_op: bool = False) -> Any:
    return _call(group, "all_gather", (to_array(tensor),), {}, async_op, _tensors)


def reduce_scatter(group: Any, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False) -> Any:
    return _call(group, "reduce_scatter", (to_array(tensor), op), {}, async_op, _tensor)


def reduce(group: Any, tensor: torch.Tensor, dst: int = 0, op: str = "sum", *, async_op: bool = False) -> Any:
    return _call(group, "reduce", (to_array(tensor), dst, op), {}, async_op, _tensor)


def send(group: Any, tensor: torch.Tensor, dst: int, *, async_op: bool = False) -> Any:
    return _call(group, "send", (to_array(tensor), dst), {}, async_op, lambda r: r)


def recv(group: Any, src: int, *, async_op: bool = False) -> Any:
    return _call(group, "recv", (src,), {}, async_op, _tensor)


# ------------------------------------------------------- parameters, state
def _named(params: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, torch.nn.Module):
        return list(params.state_dict(keep_vars=True).items())
    if isinstance(params, Mapping):
        return list(params.items())
    return [(str(i), p) for i, p in enumerate(params)]


def broadcast_parameters(
    params: torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[Any], group: Any, root_rank: int = 0
) -> None:
    """Overwrite every rank's parameters and buffers with root_rank's, in place.

    ``params``: a module (its state_dict: parameters and buffers), a dict of tensors, or
    an iterable of tensors. CPU tensors of one dtype travel as one flat broadcast.
    """
    g = _blocking(group)
    named = _named(params)
    with torch.no_grad():
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for _name, t in named:
            if t.device.type == "cpu":
                by_dtype.setdefault(t.dtype, []).append(t)
            else:
                t.copy_(from_array(g.broadcast(to_array(t.detach().contiguous()), src=root_rank)))
        for dtype in sorted(by_dtype, key=str):  # the same order on every rank
            ts = by_dtype[dtype]
            flat = torch.cat([t.detach().reshape(-1) for t in ts]) if ts else torch.empty(0, dtype=dtype)
            out = from_array(g.broadcast(to_array(flat), src=root_rank))
            off = 0
            for t in ts:
                t.copy_(out[off : off + t.numel()].view_as(t))
                off += t.numel()


def broadcast_optimizer_state(optimizer: Any, group: Any, root_rank: int = 0) -> None:
    """Give every rank root_rank's optimizer state (momentum buffers, moments, step counts, hyper-parameters)."""
    g = _blocking(group)
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    if g.rank == root_rank:
        buf = io.BytesIO()
        torch.save(inner.state_dict(), buf)
        data = np.frombuffer(buf.getbuffer(), np.uint8).copy()
    else:
        data = np.empty(0, np.uint8)
    size = g.broadcast(np.array([data.size], np.int64), src=root_rank)
    if g.rank != root_rank:
        data = np.empty(int(size[0]), np.uint8)
    data = g.broadcast(data, src=root_rank)
    if g.rank != root_rank:
        inner.load_state_dict(torch.load(io.BytesIO(data.tobytes()), weights_only=True))


# ---------------------------------------------------------- the optimizer
class _Bucket:
    __slots__ = ("flat", "handle", "params", "ready", "slices")

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        total = sum(p.numel() for p in params)
        self.flat = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        self.slices: list[tuple[int, int]] = []
        off = 0
        for p in params:
            self.slices.append((off, off + p.numel()))
            off += p.numel()
        self.ready: dict[int, int] = {}  # param index -> backward passes seen
        self.handle: Any = None


class DistributedOptimizer:
    """Wrap a torch optimizer: ``step()`` applies it to gradients averaged over the group.

    Gradients are packed into buckets (``bucket_bytes``, by dtype and device, in reverse
    parameter order as they come out of backward). With ``overlap`` (the default, torch >= 2.1),
    a bucket is averaged -- in the background, while backward goes on -- as soon as all its
    gradients are in; buckets start in one fixed order on every rank. ``step()`` averages the
    rest (a parameter that got no gradient counts as zero), waits, writes the averages into
    ``.grad`` and steps the wrapped optimizer. ``backward_passes_per_step=k`` lets k backward
    passes accumulate into ``.grad`` before the exchange. ``compression``: a codec (``"fp16"``,
    ``"bf16"``, ``"int8"``) or a compressor with error feedback (``psring.PowerSGD(rank)``,
    ``psring.TopK(ratio)``: every bucket at ``step()``, no overlap) as in :class:`psring.SyncSGD`.
    ``local_steps=H, outer=psring.optim.SGD(...)``: local SGD / DiLoCo -- ``step()`` runs the wrapped
    optimizer on this rank's copy alone, and every H steps averages the pseudo-gradients (global -
    local, with ``compression``) and takes the outer step on the global parameters (the model's at
    the first ``step()``: broadcast them first), which every rank's model then holds, the same bits
    everywhere. ``fragments=K`` streams it as :class:`psring.SyncSGD` does: the model in K fragments of
    whole parameters, fragment i's all_reduces started after the inner steps ``t % H == i*H//K`` and
    running on in the event loop's thread while the next steps compute, its outer step taken H//K steps
    later; ``use_global()`` writes the global parameters into the model at the end (the same bits on
    every rank). Everything else (``zero_grad``, ``param_groups``, ``state_dict``) is the wrapped
    optimizer's.

    ``backup=b`` (ps only): backup workers, as ``SyncSGD(..., backup=b)``. The parameters then live on
    the shards, which apply each piece once all but b workers pushed it and run the wrapped
    optimizer's update there (torch.optim.SGD, Adam or AdamW, translated to :mod:`psring.optim` with
    their hyperparameters; any other is refused); ``step()`` pushes the gradients and writes the
    shards' parameters into the model, the same on every worker. The wrapped optimizer itself is not
    stepped, so a changed learning rate (a scheduler) is an error, not silently ignored; no
    compression, no sparse_params, and no ``synchronize()`` (the average is never on a worker). A
    straggler skips the steps completed without it: end the loop on ``opt.step_count``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        group: Any,
        *,
        bucket_bytes: int = BUCKET_BYTES,
        compression: Any = None,
        backward_passes_per_step: int = 1,
        overlap: bool = True,
        sparse_params: Sequence[torch.Tensor] = (),
        backup: int = 0,
        local_steps: int = 1,
        outer: Any = None,
        fragments: int = 1,
    ) -> None:
        from ..training.compressors import Compressor
        from ..training.streaming import Streaming, split_params

        self.optimizer = optimizer
        self.group = _blocking(group)
        #: a compressor with error feedback (psring.TopK, psring.PowerSGD), else None (a codec or nothing)
        self.compressor = compression if isinstance(compression, Compressor) else None
        #: local SGD / DiLoCo: every local_steps steps the pseudo-gradients' outer step (else None)
        self.local_steps = local_steps
        self.outer = outer
        if local_steps != 1 or outer is not None:
            if type(local_steps) is not int or local_steps < 1:
                raise ValueError(f"local_steps={local_steps!r} must be a positive integer")
            from ..core.optim import SGD as OuterSGD

            self.outer = outer or OuterSGD(lr=1.0)
            if backup or sparse_params:
                raise ValueError(f"DistributedOptimizer: local_steps={local_steps} takes no backup and no "
                                 "sparse_params (not yet)")  # fmt: skip
        if type(fragments) is not int or fragments < 1:
            raise ValueError(f"DistributedOptimizer: fragments={fragments!r} must be a positive integer")
        if fragments > 1 and (self.outer is None or self.compressor is not None):
            raise ValueError(f"DistributedOptimizer: fragments={fragments} needs local_steps > 1 and takes a codec, "
                             "not a compressor")  # fmt: skip
        #: streaming local SGD (fragments > 1): the fragments' schedule and the exchange in flight
        self._streaming: Any = None
        self._inner_steps = 0
        #: local SGD: seconds step() waited on exchanges in all (what compute use is measured against)
        self.waited_s = 0.0
        self._local_since = 0
        self._global: list[np.ndarray] | None = None  # local SGD: the global parameters, by bucket
        self._outer_state: list[dict[str, Any]] = []
        self.backup = backup
        self._shards: Any = None  # backup: the BlockingSyncSGD whose shards hold the parameters
        #: parameters whose gradients come sparse (nn.Embedding(sparse=True)): not in the buckets;
        #: their rows are summed with sparse_all_reduce (rank order) and averaged, in this order
        self.sparse_params = list(sparse_params)
        sparse_ids = {id(p) for p in self.sparse_params}
        if type(backward_passes_per_step) is not int or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} must be a positive integer")
        self.compression = compression
        self.passes = backward_passes_per_step
        params = [p for grp in optimizer.param_groups for p in grp["params"] if p.requires_grad]
        if any(id(p) not in {id(q) for q in params} for p in self.sparse_params):
            raise ValueError("DistributedOptimizer: sparse_params must be the optimizer's parameters that require grad")
        if any(p.dim() != 2 for p in self.sparse_params):
            raise ValueError("DistributedOptimizer: sparse_params must be 2-D (rows x width, as nn.Embedding's weight)")
        params = [p for p in params if id(p) not in sparse_ids]
        if not params and not self.sparse_params:
            raise ValueError("DistributedOptimizer: the optimizer has no parameters that require grad")
        if self.compressor is None:
            codec_named(compression)  # an unknown codec is named here, not at the first step
        if compression is not None and any(p.dtype != torch.float32 for p in params):
            raise TypeError(f"compression={compression!r} needs float32 parameters")
        if type(backup) is not int or backup < 0:
            raise ValueError(f"DistributedOptimizer: backup={backup!r} must be a non-negative integer")
        if backup and compression is not None:
            raise ValueError(f"DistributedOptimizer: backup={backup} takes no compression: its scale is agreed over "
                             "every worker before a step, which backup workers exist not to wait for")  # fmt: skip
        if backup and self.sparse_params:
            raise ValueError(
                f"DistributedOptimizer: backup={backup} takes no sparse_params (not yet: with backup workers the "
                "parameters live on the shards, and an embedding's rows would come back to the model each step; "
                "psring.SyncSGD(sparse=..., backup=b) keeps tables there)"
            )
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, index)
        current: list[torch.Tensor] = []
        size = 0
        order = [] if backup else list(reversed(params))  # last layers' gradients come first; backup: no buckets
        # streaming: a bucket never spans two fragments (whole parameters, about equal in bytes)
        cuts = set(split_params([p.numel() * p.element_size() for p in order], fragments)) if fragments > 1 else set()
        frag_of_bucket: list[int] = []
        for j, p in enumerate(order):
            nbytes = p.numel() * p.element_size()
            if current and (
                size + nbytes > bucket_bytes or p.dtype != current[0].dtype or p.device != current[0].device
                or j in cuts
            ):
                self._add_bucket(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self._add_bucket(current)
        if fragments > 1:
            starts = sorted(cuts)
            position = {id(p): j for j, p in enumerate(order)}
            for bucket in self.buckets:
                frag_of_bucket.append(sum(1 for c in starts if c <= position[id(bucket.params[0])]) - 1)
            by_fragment = [[b for b, f in enumerate(frag_of_bucket) if f == i] for i in range(fragments)]
            self._streaming = Streaming(fragments, local_steps, by_fragment)
        self._next = 0  # the next bucket to launch (in order, the same on every rank)
        self._hooks = []
        if backup:
            self._start_on_shards(params, backup)
            overlap = False  # nothing is averaged on the workers
        if self.compressor is not None or self.outer is not None:
            overlap = False  # a compressor takes every bucket at once; local SGD exchanges every H steps
            if any(p.device.type != "cpu" for p in params):
                raise TypeError("DistributedOptimizer: a compressor or local_steps takes CPU parameters (not yet CUDA)")
        if self.compressor is not None:
            from ..training.local import Bucket as FlatBucket

            flat_buckets = []
            for bucket in self.buckets:
                fb = FlatBucket(np.float32)
                for i, p in enumerate(bucket.params):
                    fb.add(f"p{i}", tuple(p.shape), p.numel())
                flat_buckets.append(fb)
            self.compressor.bind(flat_buckets)
        self.overlap = overlap and hasattr(torch.Tensor, "register_post_accumulate_grad_hook")
        if self.overlap:
            for p in params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    # ------------------------------------------------------- backup workers
    def _start_on_shards(self, params: list[torch.Tensor], backup: int) -> None:
        from ..training.sgd import BlockingSyncSGD

        self._params = params
        self._hyper = _shard_optimizer(self.optimizer)
        arrays = {f"p{i}": to_array(p.detach()) for i, p in enumerate(params)}
        self._shards = BlockingSyncSGD(self.group, arrays, self._hyper[0], backup=backup)
        self._write_params(self._shards.start())  # rank 0's parameters, now the shards'

    def _write_params(self, arrays: Mapping[str, Any]) -> None:
        with torch.no_grad():
            for i, p in enumerate(self._params):
                p.copy_(from_array(arrays[f"p{i}"]).view_as(p))  # numpy or cupy, as the parameters

    def _step_on_shards(self) -> None:
        now = _shard_optimizer(self.optimizer)[1]
        if now != self._hyper[1]:
            raise ValueError(
                f"DistributedOptimizer(backup={self.backup}): the optimizer's hyperparameters changed from "
                f"{self._hyper[1]} to {now}; the shards run it as it was at construction (no schedules with backup)"
            )
        grads = {  # a parameter that got no gradient counts as zero, as in the averaged path
            f"p{i}": to_array((p.grad if p.grad is not None else torch.zeros_like(p)).detach())
            for i, p in enumerate(self._params)
        }
        self._write_params(self._shards.step(grads))

    @property
    def step_count(self) -> int:
        """Backup workers: the steps the job has taken, as this worker last saw them. A straggler skips
        the steps the others completed without it, so loop on this (``while opt.step_count < T``),
        not on a count of your own: a worker still stepping after the others stopped waits forever."""
        return self._shards.step_count if self._shards is not None else 0

    @property
    def skipped(self) -> int:
        """Backup workers: the steps this worker skipped, the others having completed them without it."""
        return self._shards.skipped if self._shards is not None else 0

    def _add_bucket(self, params: list[torch.Tensor]) -> None:
        b = len(self.buckets)
        for i, p in enumerate(params):
            self._where[id(p)] = (b, i)
        self.buckets.append(_Bucket(params))

    # ----------------------------------------------------------- exchange
    def _grad_ready(self, p: torch.Tensor) -> None:
        b, i = self._where[id(p)]
        bucket = self.buckets[b]
        if bucket.handle is not None:
            raise RuntimeError(
                "DistributedOptimizer: a gradient arrived after its bucket was sent -- more backward passes "
                f"than backward_passes_per_step={self.passes} before step()"
            )
        bucket.ready[i] = bucket.ready.get(i, 0) + 1
        while self._next < len(self.buckets):
            nxt = self.buckets[self._next]
            if len(nxt.ready) < len(nxt.params) or min(nxt.ready.values()) < self.passes:
                break
            self._launch(nxt)

    def _launch(self, bucket: _Bucket) -> None:
        with torch.no_grad():
            for p, (a, z) in zip(bucket.params, bucket.slices, strict=True):
                if p.grad is None:
                    bucket.flat[a:z].zero_()
                else:
                    bucket.flat[a:z].copy_(p.grad.reshape(-1))
        bucket.handle = self.group.all_reduce(
            to_array(bucket.flat), op="avg", compression=self.compression, async_op=True
        )
        self._next += 1

    def synchronize(self) -> None:
        """Average every gradient now (launching what backward did not) and write them into ``.grad``."""
        if self._shards is not None:
            raise RuntimeError(
                f"DistributedOptimizer(backup={self.backup}): gradients are averaged on the shards, never on a "
                "worker; call step()"
            )
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        with torch.no_grad():
            for bucket in self.buckets:
                avg = from_array(bucket.handle.wait())
                for p, (a, z) in zip(bucket.params, bucket.slices, strict=True):
                    if p.grad is None:
                        p.grad = avg[a:z].view_as(p).clone()
                    else:
                        p.grad.copy_(avg[a:z].view_as(p))
                bucket.handle = None
                bucket.ready.clear()
            for p in self.sparse_params:
                self._sparse_average(p)
        self._next = 0

    def _sparse_average(self, p: torch.Tensor) -> None:
        """p's sparse gradient: every rank's rows summed in rank order, divided by the world size."""
        n, width = p.shape
        dtype = p.dtype
        if p.grad is None:
            idx, val = np.empty(0, np.int64), np.empty((0, width), to_array(p.detach()[:0]).dtype)
        elif not p.grad.is_sparse:
            raise TypeError(
                f"DistributedOptimizer: a parameter in sparse_params got a dense gradient ({tuple(p.shape)}); "
                "give it sparse gradients (nn.Embedding(sparse=True)) or leave it out of sparse_params"
            )
        else:
            g = p.grad.coalesce()
            idx = g.indices()[0].numpy().astype(np.int64)
            val = to_array(g.values().contiguous())
        out = self.group.sparse_all_reduce(SparseRows(idx, val, n))
        rows = from_array(out.values) / self.group.world_size
        p.grad = torch.sparse_coo_tensor(from_array(out.indices)[None], rows.to(dtype), (n, width)).coalesce()

    def _flats_of(self, what: str, ids: Sequence[int] | None = None) -> list[np.ndarray]:
        """Every bucket's (or buckets ``ids``') gradients ("grad", a missing one as zero) or parameters
        ("param"), flat, as numpy."""
        out = []
        with torch.no_grad():
            for bucket in self.buckets if ids is None else [self.buckets[b] for b in ids]:
                for p, (a, z) in zip(bucket.params, bucket.slices, strict=True):
                    src = p if what == "param" else p.grad
                    if src is None:
                        bucket.flat[a:z].zero_()
                    else:
                        bucket.flat[a:z].copy_(src.detach().reshape(-1))
                out.append(np.array(to_array(bucket.flat), np.float32))
        return out

    def _write(self, flats: list[np.ndarray], what: str, ids: Sequence[int] | None = None) -> None:
        with torch.no_grad():
            chosen = self.buckets if ids is None else [self.buckets[b] for b in ids]
            for bucket, flat in zip(chosen, flats, strict=True):
                got = from_array(np.ascontiguousarray(flat))
                for p, (a, z) in zip(bucket.params, bucket.slices, strict=True):
                    if what == "param":
                        p.copy_(got[a:z].view_as(p))
                    elif p.grad is None:
                        p.grad = got[a:z].view_as(p).clone()
                    else:
                        p.grad.copy_(got[a:z].view_as(p))

    def _average(self, flats: list[np.ndarray]) -> list[np.ndarray]:
        """The buckets' average over the group: the compressor's (error feedback), or all_reduces."""
        if self.compressor is not None:
            return self.group.portal.call(self.compressor.exchange(self.group.group, flats))
        handles = [self.group.all_reduce(f, op="avg", compression=self.compression, async_op=True) for f in flats]
        return [np.asarray(h.wait(), np.float32) for h in handles]

    def _stream_step(self, closure: Any) -> Any:
        """Streaming local SGD (fragments=K): the wrapped optimizer on this rank's copy; after inner step t
        the exchange due lands (its outer step, then this rank's copy of the fragment = the new global
        parameters + the progress since it started), and the fragment due starts its all_reduces, which
        run on in the event loop's thread while the next steps compute. As SyncSGD(fragments=K)."""
        from ..training.streaming import Flight

        s = self._streaming
        if self._global is None:
            self._global = self._flats_of("param")
            self._outer_state = [self.outer.init_state(g) for g in self._global]
        loss = self.optimizer.step(closure)
        self._inner_steps += 1
        t = self._inner_steps
        if s.flight is not None and s.flight.due <= t:
            self._land()
        i = s.starting(t)
        if i is not None:
            if s.flight is not None:
                self._land()
            ids = s.buckets_of[i]
            local = self._flats_of("param", ids)
            pseudo = [self._global[b] - loc for b, loc in zip(ids, local, strict=True)]
            handles = [self.group.all_reduce(p, op="avg", compression=self.compression, async_op=True)
                       for p in pseudo]  # fmt: skip
            s.flight = Flight(i, t + s.delay, handles, local)  # type: ignore[arg-type]
        return loss

    def _land(self) -> None:
        s, glob = self._streaming, self._global
        assert glob is not None
        flight, s.flight = s.flight, None
        ids = s.buckets_of[flight.fragment]
        t0 = time.perf_counter()
        avgs = [np.asarray(h.wait(), np.float32) for h in flight.task]
        self.waited_s += time.perf_counter() - t0
        s.rounds[flight.fragment] += 1
        for b, avg in zip(ids, avgs, strict=True):
            self.outer.update(glob[b], avg, self._outer_state[b])
        now = self._flats_of("param", ids)
        self._write([glob[b] + (loc - snap) for b, loc, snap in zip(ids, now, flight.snaps, strict=True)], "param", ids)

    def use_global(self) -> None:
        """Local SGD: write the global parameters into the model -- the same bits on every rank, what to
        evaluate or save at the end. With fragments the exchange in flight is waited for and its outer
        step taken first. The inner steps since each fragment's last exchange are dropped from the model
        (a later ``step()`` goes on from the global parameters)."""
        if self.outer is None or self._global is None:
            return
        if self._streaming is not None and self._streaming.flight is not None:
            self._land()
        self._write(self._global, "param")

    def _local_step(self, closure: Any) -> Any:
        """Local SGD: the wrapped optimizer on this rank's own copy; every local_steps steps the
        pseudo-gradients (global - local) averaged and the outer step on the global parameters, which
        every rank's model then takes (the same bits everywhere)."""
        if self._global is None:  # the global parameters: the model's at the first step (rank 0's after
            self._global = self._flats_of("param")  # broadcast_parameters)
            self._outer_state = [self.outer.init_state(g) for g in self._global]
        loss = self.optimizer.step(closure)
        self._local_since += 1
        if self._local_since >= self.local_steps:
            local = self._flats_of("param")
            t0 = time.perf_counter()
            avgs = self._average([g - loc for g, loc in zip(self._global, local, strict=True)])
            self.waited_s += time.perf_counter() - t0
            for g, avg, st in zip(self._global, avgs, self._outer_state, strict=True):
                self.outer.update(g, avg, st)
            self._write(self._global, "param")
            self._local_since = 0
        return loss

    def step(self, closure: Any = None) -> Any:
        if self._shards is not None:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._step_on_shards()
            return loss
        if self._streaming is not None:
            return self._stream_step(closure)
        if self.outer is not None:
            return self._local_step(closure)
        if self.compressor is not None:
            self._write(self._average(self._flats_of("grad")), "grad")
            for p in self.sparse_params:
                self._sparse_average(p)
            return self.optimizer.step(closure)
        self.synchronize()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r}, {len(self.buckets)} buckets, overlap={self.overlap})"


def _shard_optimizer(optimizer: torch.optim.Optimizer) -> tuple[Any, dict[str, Any]]:
    """The psring.optim twin of a torch SGD, Adam or AdamW (one set of hyperparameters for every
    parameter group), and those hyperparameters; TypeError/ValueError for what has none."""
    from ..core import optim as popt

    kinds = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}
    kind = kinds.get(type(optimizer))
    if kind is None:
        raise TypeError(
            f"DistributedOptimizer(backup=...): the shards run torch.optim.SGD, Adam or AdamW, not "
            f"{type(optimizer).__name__}"
        )
    adam = ("lr", "betas", "eps", "weight_decay")
    keys = {"sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov"), "adam": adam, "adamw": adam}[kind]
    groups = [{k: (tuple(g[k]) if k == "betas" else g[k]) for k in keys} for g in optimizer.param_groups]
    if any(g != groups[0] for g in groups):
        raise ValueError("DistributedOptimizer(backup=...): every parameter group must have the same hyperparameters")
    for flag in ("maximize", "amsgrad", "differentiable"):
        if any(g.get(flag) for g in optimizer.param_groups):
            raise ValueError(f"DistributedOptimizer(backup=...): {flag}=True is not run on the shards")
    hyper = groups[0]
    cls = {"sgd": popt.SGD, "adam": popt.Adam, "adamw": popt.AdamW}[kind]
    return cls(**{k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in hyper.items()}), hyper


__all__ = [
    "BackendError",
    "DistributedOptimizer",
    "ProcessGroupPsring",
    "all_gather",
    "all_reduce",
    "broadcast",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "from_array",
    "recv",
    "reduce",
    "reduce_scatter",
    "register",
    "send",
    "to_array",
]
