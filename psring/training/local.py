"""The model as one rank holds it: its parameters in a few flat *buckets* (many tensors each, so a
model with hundreds of tensors sends few frames) with a view per parameter, the optimizer state where
the rank runs the optimizer, and its sparse tables (row-addressed embeddings). SyncSGD keeps one; its
placement (``placement``) decides what of it a rank fills in. The layout and the checks of what goes
in and out (gradients, row indices, a checkpoint) are here; what moves on the wire is not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..core.arrays import array_module, check_array, dtype_name
from ..core.sparse import SparseRows
from .streaming import split_params

#: default bucket size (torch DDP's default is 25 MiB)
BUCKET_BYTES = 25 << 20


def to_host(x: Any) -> np.ndarray:
    """A numpy array of x (a cupy array copied off its device)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "get"):
        return x.get()  # cupy
    return np.asarray(x)


def like(xp: Any, host: np.ndarray) -> Any:
    """host on the array module xp's device."""
    return host if xp is np else xp.asarray(host)


class Bucket:
    """Parameters of one dtype laid end to end: each one's name, shape and offset."""

    __slots__ = ("dtype", "names", "nbytes", "offsets", "shapes", "size")

    def __init__(self, dtype: Any) -> None:
        self.dtype = dtype
        self.names: list[str] = []
        self.shapes: list[tuple[int, ...]] = []
        self.offsets: list[int] = []
        self.size = 0
        self.nbytes = 0

    def add(self, name: str, shape: tuple[int, ...], count: int) -> None:
        self.names.append(name)
        self.shapes.append(shape)
        self.offsets.append(self.size)
        self.size += count
        self.nbytes = self.size * np.dtype(self.dtype).itemsize

    def spans(self) -> Any:
        """(name, offset, shape, count) of each parameter in it."""
        for name, off, shape in zip(self.names, self.offsets, self.shapes, strict=True):
            yield name, off, shape, int(np.prod(shape)) if shape else 1


def make_buckets(params: Mapping[str, Any], bucket_bytes: int = BUCKET_BYTES) -> list[Bucket]:
    """Group tensors, in the dict's order, into flat buckets of one dtype and at most bucket_bytes."""
    buckets: list[Bucket] = []
    open_by_dtype: dict[str, Bucket] = {}
    for name, p in params.items():
        key = dtype_name(p.dtype)
        bucket = open_by_dtype.get(key)
        if bucket is None or (bucket.size and bucket.nbytes + p.nbytes > bucket_bytes):
            bucket = Bucket(p.dtype)
            buckets.append(bucket)
            open_by_dtype[key] = bucket
        bucket.add(name, tuple(p.shape), int(p.size))
    return buckets


class LocalModel:
    """The dense parameters (``flat``: one array a bucket; ``views()``: one per parameter), their
    optimizer state (``state``, a dict a bucket), and the sparse tables (``tables``, with
    ``table_state``; None where the topology's shards hold them). Every array on one device (``xp``)."""

    def __init__(
        self, params: Mapping[str, Any], sparse: Sequence[str], bucket_bytes: int, fragments: int = 1
    ) -> None:
        self.sparse = list(sparse)
        self.tables: dict[str, Any] = {k: check_array(params[k], f"params[{k!r}]") for k in self.sparse}
        self.table_state: dict[str, dict[str, Any]] = {}
        #: each table's (rows, width, dtype name)
        self.table_shape = {k: (int(v.shape[0]), int(v.shape[1]), dtype_name(v.dtype)) for k, v in self.tables.items()}
        #: the tables' optimizer state from a checkpoint, by table (taken by start)
        self.loaded_tables: dict[str, dict[str, np.ndarray]] = {}
        #: rows that came back with the last step (step(..., prefetch=...)): name -> (indices, rows)
        self.prefetched: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        dense = {k: check_array(v, f"params[{k!r}]") for k, v in params.items() if k not in self.tables}
        self.names = list(dense)
        xps = {array_module(v) for v in [*dense.values(), *self.tables.values()]}
        if len(xps) > 1:
            raise TypeError("SyncSGD: params mix numpy and cupy arrays; keep them on one device")
        self.xp = xps.pop()
        #: the buckets of each fragment (streaming local SGD: whole parameters, in order, about equal in
        #: bytes; one fragment of every bucket otherwise)
        self.fragments: list[list[int]] = []
        self.buckets: list[Bucket] = []
        names = list(dense)
        starts = split_params([int(v.nbytes) for v in dense.values()], fragments) if fragments > 1 else [0]
        for a, z in zip(starts, [*starts[1:], len(names)], strict=True):
            made = make_buckets({n: dense[n] for n in names[a:z]}, bucket_bytes)
            self.fragments.append(list(range(len(self.buckets), len(self.buckets) + len(made))))
            self.buckets += made
        self.flat = self.flats(dense, "params")
        self.state: list[dict[str, Any]] = []

    # ------------------------------------------------------------ dense
    def flats(self, arrays: Mapping[str, Any], what: str = "grads") -> list[Any]:
        """arrays (one per parameter, on this device) laid out as the buckets: one new array each."""
        out = []
        for bucket, pieces in zip(self.buckets, self.pieces(arrays, what), strict=True):
            flat = self.xp.empty(bucket.size, dtype=bucket.dtype)
            for off, a in pieces:
                flat[off : off + a.size] = a
            out.append(flat)
        return out

    def pieces(self, arrays: Mapping[str, Any], what: str = "grads") -> list[list[tuple[int, Any]]]:
        """arrays (one per parameter, on this device) as each bucket's (offset, flat view) pieces: the
        bucket layout without a copy (local SGD's inner step updates its copy piece by piece)."""
        xp = self.xp
        out = []
        for bucket in self.buckets:
            pieces = []
            for name, off, shape, _count in bucket.spans():
                a = arrays[name]
                if tuple(a.shape) != shape or a.dtype != bucket.dtype:
                    raise ValueError(
                        f"{what}[{name!r}] has shape {tuple(a.shape)} dtype {a.dtype}, "
                        f"the parameter has {shape} {bucket.dtype}"
                    )
                if array_module(a) is not xp:
                    raise TypeError(f"{what}[{name!r}] is on another device than the parameters")
                pieces.append((off, a.reshape(-1)))
            out.append(pieces)
        return out

    def views(self, flats: list[Any] | None = None) -> dict[str, Any]:
        """One view of ``flat`` (or of ``flats``, laid out alike: local SGD's local copies) per
        parameter, in the parameters' order (what ``opt.params`` is)."""
        out = {}
        for bucket, flat in zip(self.buckets, self.flat if flats is None else flats, strict=True):
            for name, off, shape, count in bucket.spans():
                out[name] = flat[off : off + count].reshape(shape)
        return {name: out[name] for name in self.names}

    def by_name(self, flats: list[Any]) -> dict[str, np.ndarray]:
        """Per-bucket arrays (parameters or a state key's) as host copies by parameter name."""
        out = {}
        for bucket, flat in zip(self.buckets, flats, strict=True):
            for name, off, shape, count in bucket.spans():
                out[name] = np.array(flat[off : off + count]).reshape(shape)
        return out

    def host_flats(self, arrays: Mapping[str, Any]) -> list[np.ndarray]:
        """A checkpoint's arrays by parameter name laid out as the buckets, on the host."""
        missing = [n for n in self.names if n not in arrays]
        if missing:
            raise ValueError(f"the checkpoint lacks {missing}")
        out = []
        for bucket in self.buckets:
            flat = np.empty(bucket.size, dtype=bucket.dtype)
            for name, off, shape, count in bucket.spans():
                a = to_host(arrays[name])
                if tuple(a.shape) != shape:
                    raise ValueError(f"the checkpoint's {name!r} has shape {tuple(a.shape)}, the parameter has {shape}")
                flat[off : off + count] = a.reshape(-1)
            out.append(flat)
        return out

    def layout(self) -> list[list[Any]]:
        """The buckets as every rank must agree on them: dtype, names, shapes."""
        return [[dtype_name(b.dtype), b.names, [list(s) for s in b.shapes]] for b in self.buckets]

    # ------------------------------------------------------------ sparse tables
    def row_ids(self, name: str, indices: Any, what: str) -> np.ndarray:
        """Row indices of sparse table ``name`` as a flat host array; KeyError, TypeError or IndexError
        (naming the index) for what does not fit it."""
        if name not in self.table_shape:
            raise KeyError(f"{name!r} is not a sparse table of this SyncSGD (sparse={self.sparse})")
        idx = to_host(check_array(indices, "indices")).reshape(-1)
        rows = self.table_shape[name][0]
        if idx.dtype.kind not in "iu":
            raise TypeError(f"{what}({name!r}): indices must be integers, got {idx.dtype}")
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= rows):
            bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
            raise IndexError(f"{what}({name!r}): index {bad} is outside the table's rows 0..{rows - 1}")
        return idx

    def rows_of(self, grads: Mapping[str, Any]) -> dict[str, SparseRows]:
        """Every sparse table's gradient rows, checked to be SparseRows of the table's shape."""
        out = {}
        for name in self.sparse:
            rows, width, dtype = self.table_shape[name]
            g = grads[name]
            if not isinstance(g, SparseRows):
                raise TypeError(f"grads[{name!r}] must be a psring.SparseRows (it is a sparse table), got "
                                f"{type(g).__name__}")  # fmt: skip
            if (g.num_rows, g.width, dtype_name(g.values.dtype)) != (rows, width, dtype):
                raise ValueError(f"grads[{name!r}] has rows of {g.num_rows} x {g.width} {g.values.dtype}; "
                                 f"the table is {rows} x {width} {dtype}")  # fmt: skip
            out[name] = g
        return out

    def table_from(
        self, name: str, saved: Mapping[str, Any], state_keys: list[str]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """A sparse table's rows and optimizer state from a checkpoint, checked against the table."""
        num_rows, width, dtype = self.table_shape[name]
        rows = np.array(saved["rows"])
        if rows.shape != (num_rows, width) or dtype_name(rows.dtype) != dtype:
            raise ValueError(f"the checkpoint's sparse table {name!r} is {rows.dtype}{list(rows.shape)}, "
                             f"the table is {dtype}[{num_rows}, {width}]")  # fmt: skip
        table_state = {k: np.array(v) for k, v in dict(saved.get("state") or {}).items()}
        if sorted(table_state) != state_keys or any(v.shape != rows.shape for v in table_state.values()):
            raise ValueError(f"the checkpoint's sparse table {name!r} has optimizer state "
                             f"{ {k: list(v.shape) for k, v in table_state.items()} }, the optimizer keeps "
                             f"{state_keys} of the table's shape")  # fmt: skip
        return rows, table_state
