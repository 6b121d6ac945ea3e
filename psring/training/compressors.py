"""Compressors with error feedback for SyncSGD: PowerSGD (low rank) and TopK (the largest entries).

A codec (psring.core.codec) narrows every element of an all_reduce; a compressor sends far fewer of
them and keeps what it did not send -- the *error* -- to add to the next step's gradient (error
feedback: nothing is lost, only late). Its state is this rank's own (every rank's error differs);
what the ranks receive is the same bits everywhere, on both topologies, because it is made of the
group's canonical collectives (``all_reduce``, ``sparse_all_reduce``) and of arithmetic that gives the
same bits on identical inputs (no BLAS where the inputs are the ranks' shared results).

``exchange`` is all or nothing: the new error is kept only once every collective of the step ended,
so a step that fails (a lost rank, elastic) and is taken again starts from the same error.

- :class:`TopK` ``(ratio)``: per bucket, the ``ceil(ratio * n)`` entries of gradient + error largest in
  magnitude travel as rows (``sparse_all_reduce``: summed in rank order); the rest stays as the error.
  A bucket where rows would not be fewer bytes than the dense all_reduce travels dense.
- :class:`PowerSGD` ``(rank)``: per parameter of two or more dimensions (as a matrix, its first
  dimension by the rest), Vogels et al.'s one power iteration with warm start: ``P = M Q``, averaged
  and orthonormalised; ``Q = M^T P``, averaged; ``M ~ P Q^T``; the error ``M - P Q^T``. One-dimensional
  parameters and matrices that low rank would not make smaller travel dense, in one all_reduce. Q
  starts from one seeded draw on every rank.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core.codec import CODECS
from ..core.sparse import SparseRows
from .local import Bucket


class Compressor:
    """What SyncSGD(..., compression=...) takes besides a codec: see the module's docstring."""

    name = ""

    def __init__(self) -> None:
        self._errors: list[np.ndarray] | None = None
        self._buckets: list[Bucket] = []

    def describe(self) -> str:
        """The name and setting (``"topk:0.01"``): what the ranks agree on and a checkpoint records."""
        raise NotImplementedError

    def bind(self, buckets: Sequence[Bucket]) -> None:
        """The buckets the gradients come in (SyncSGD's, in their order); the error starts at zero."""
        for b in buckets:
            if np.dtype(b.dtype) != np.float32:
                raise TypeError(f"compression={self.describe()!r} needs float32 parameters, got {np.dtype(b.dtype)}")
        self._buckets = list(buckets)
        self._errors = [np.zeros(b.size, np.float32) for b in buckets]

    async def exchange(self, group: Any, flats: list[np.ndarray]) -> list[np.ndarray]:
        """Every bucket's average over the group (what every rank receives alike), this rank's error
        fed back in and the new one kept once every collective ended."""
        assert self._errors is not None, "bind() first"
        accs = [np.add(f.reshape(-1), e) for f, e in zip(flats, self._errors, strict=True)]
        outs, errors = await self._exchange(group, accs)
        self._errors = errors
        return outs

    async def _exchange(self, group: Any, accs: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        raise NotImplementedError

    # --------------------------------------------------------------- checkpoints
    def state(self) -> list[np.ndarray]:
        """This rank's error feedback (a checkpoint's), by bucket."""
        assert self._errors is not None
        return [e.copy() for e in self._errors]

    def load(self, errors: Sequence[np.ndarray]) -> None:
        """Resume this rank's error feedback from a checkpoint's."""
        if len(errors) != len(self._buckets) or any(
            np.asarray(e).size != b.size for e, b in zip(errors, self._buckets, strict=True)
        ):
            raise ValueError("the checkpoint's error feedback does not match these parameters' buckets")
        self._errors = [np.asarray(e, np.float32).reshape(-1).copy() for e in errors]

    def __repr__(self) -> str:
        return f"psring.{type(self).__name__}({self.describe()})"


class TopK(Compressor):
    """The largest ``ratio`` of each bucket's entries, with error feedback (see the module's docstring)."""

    name = "topk"

    def __init__(self, ratio: float) -> None:
        super().__init__()
        if not (isinstance(ratio, (int, float)) and 0.0 < float(ratio) <= 1.0):
            raise ValueError(f"TopK(ratio={ratio!r}): the share of each bucket sent must be in (0, 1]")
        self.ratio = float(ratio)

    def describe(self) -> str:
        return f"topk:{self.ratio:g}"

    def k_of(self, n: int) -> int:
        return max(1, math.ceil(self.ratio * n)) if n else 0

    def sparse(self, n: int, world: int) -> bool:
        """Whether a bucket of n elements travels as rows: an index and a value each (12 bytes), every
        rank's k of them to every rank, against the dense all_reduce's 2 (N-1)/N x 4 bytes an element."""
        return n > 0 and 12 * self.k_of(n) * world < 8 * n * (world - 1) / max(world, 1)

    async def _exchange(self, group: Any, accs: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        world = group.world_size
        calls, errors = [], []
        for acc in accs:
            n = acc.size
            if not self.sparse(n, world):
                calls.append(group.all_reduce(acc, op="avg"))
                errors.append(np.zeros(n, np.float32))
                continue
            k = self.k_of(n)
            idx = np.sort(np.argpartition(np.abs(acc), n - k)[n - k :]).astype(np.int64)
            calls.append(group.sparse_all_reduce(SparseRows(idx, acc[idx].reshape(k, 1), n)))
            err = acc.copy()
            err[idx] = 0.0  # what was sent leaves the error
            errors.append(err)
        got = await asyncio.gather(*calls, return_exceptions=True)
        for g in got:
            if isinstance(g, BaseException):
                raise g
        outs = []
        for acc, g in zip(accs, got, strict=True):
            if isinstance(g, SparseRows):
                avg = np.zeros(acc.size, np.float32)
                avg[np.asarray(g.indices)] = np.asarray(g.values, np.float32)[:, 0] / np.float32(world)
                outs.append(avg)
            else:
                outs.append(np.asarray(g, np.float32))
        return outs, errors


def _orthonormalise(p: np.ndarray) -> None:
    """Gram-Schmidt on p's columns, in place, with numpy's own reductions (no BLAS): the same bits on
    every rank, which all hold the same averaged p."""
    for i in range(p.shape[1]):
        col = p[:, i]
        for j in range(i):
            col -= np.sum(col * p[:, j], dtype=np.float32) * p[:, j]
        norm = np.float32(np.sqrt(np.sum(col * col, dtype=np.float32)))
        col /= norm if norm > 0 else np.float32(1.0)


def _low_rank(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """p q^T as a sum of outer products, elementwise (no BLAS: the same bits on every rank)."""
    out = np.zeros((p.shape[0], q.shape[0]), np.float32)
    for k in range(p.shape[1]):
        out += np.multiply.outer(p[:, k], q[:, k])
    return out


class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD with error feedback and warm start (see the module's docstring)."""

    name = "powersgd"
    SEED = 1729

    def __init__(self, rank: int) -> None:
        super().__init__()
        if type(rank) is not int or rank < 1:
            raise ValueError(f"PowerSGD(rank={rank!r}): the rank must be a positive integer")
        self.rank = rank
        #: per bucket, per compressed parameter: (offset, rows, cols); and each one's Q (warm start)
        self._matrices: list[list[tuple[int, int, int]]] = []
        self._q: list[list[np.ndarray]] = []

    def describe(self) -> str:
        return f"powersgd:{self.rank}"

    def bind(self, buckets: Sequence[Bucket]) -> None:
        super().bind(buckets)
        rng = np.random.default_rng(self.SEED)  # the same draw on every rank
        self._matrices, self._q = [], []
        for b in buckets:
            mats, qs = [], []
            for _name, off, shape, count in b.spans():
                if len(shape) < 2:
                    continue
                rows, cols = shape[0], count // shape[0]
                if self.rank * (rows + cols) * 2 > rows * cols:  # low rank would not halve it: dense
                    continue
                mats.append((off, rows, cols))
                qs.append(rng.standard_normal((cols, self.rank)).astype(np.float32))
            self._matrices.append(mats)
            self._q.append(qs)

    async def _exchange(self, group: Any, accs: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        # P = M Q of every matrix of every bucket in one all_reduce; then Q = M^T P in another; the rest dense
        ms = [
            [acc[off : off + r * c].reshape(r, c) for off, r, c in mats]
            for acc, mats in zip(accs, self._matrices, strict=True)
        ]
        ps = [[m @ q for m, q in zip(bm, bq, strict=True)] for bm, bq in zip(ms, self._q, strict=True)]
        dense = [self._dense_part(acc, mats) for acc, mats in zip(accs, self._matrices, strict=True)]
        flat_p = np.concatenate([p.reshape(-1) for bp in ps for p in bp] or [np.zeros(0, np.float32)])
        flat_d = np.concatenate([d for d in dense] or [np.zeros(0, np.float32)])
        avg_p, avg_d = await self._both(group, flat_p, flat_d)
        off, new_p = 0, []
        for bp in ps:
            got = []
            for p in bp:
                ap = avg_p[off : off + p.size].reshape(p.shape).copy()
                off += p.size
                _orthonormalise(ap)
                got.append(ap)
            new_p.append(got)
        qs = [[m.T @ p for m, p in zip(bm, bp, strict=True)] for bm, bp in zip(ms, new_p, strict=True)]
        flat_q = np.concatenate([q.reshape(-1) for bq in qs for q in bq] or [np.zeros(0, np.float32)])
        avg_q = await group.all_reduce(flat_q, op="avg") if flat_q.size else flat_q
        outs, errors, new_q, off_q, off_d = [], [], [], 0, 0
        for acc, mats, bm, bp, bq in zip(accs, self._matrices, ms, new_p, qs, strict=True):
            out = np.zeros(acc.size, np.float32)
            err = np.zeros(acc.size, np.float32)
            dense_idx = self._dense_index(acc.size, mats)
            out[dense_idx] = avg_d[off_d : off_d + dense_idx.size]
            off_d += dense_idx.size
            got_q = []
            for (off, r, c), m, p, q in zip(mats, bm, bp, bq, strict=True):
                aq = avg_q[off_q : off_q + q.size].reshape(q.shape).copy()
                off_q += q.size
                approx = _low_rank(p, aq)
                out[off : off + r * c] = approx.reshape(-1)
                err[off : off + r * c] = (m - approx).reshape(-1)
                got_q.append(aq)
            new_q.append(got_q)
            outs.append(out)
            errors.append(err)
        self._q = new_q  # warm start: the next step's Q (kept, as the error, only now)
        return outs, errors

    async def _both(self, group: Any, p: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        calls = [group.all_reduce(x, op="avg") if x.size else _ready(x) for x in (p, d)]
        got = await asyncio.gather(*calls, return_exceptions=True)
        for g in got:
            if isinstance(g, BaseException):
                raise g
        return np.asarray(got[0], np.float32), np.asarray(got[1], np.float32)

    @staticmethod
    def _dense_index(n: int, mats: list[tuple[int, int, int]]) -> np.ndarray:
        keep = np.ones(n, bool)
        for off, r, c in mats:
            keep[off : off + r * c] = False
        return np.flatnonzero(keep)

    def _dense_part(self, acc: np.ndarray, mats: list[tuple[int, int, int]]) -> np.ndarray:
        return acc[self._dense_index(acc.size, mats)]

    # the warm start's Q is part of the state: a resumed run takes the same next steps
    def state(self) -> list[np.ndarray]:
        return [*super().state(), *(q.copy() for bq in self._q for q in bq)]

    def load(self, errors: Sequence[np.ndarray]) -> None:
        n = len(self._buckets)
        super().load(errors[:n])
        qs = list(errors[n:])
        want = sum(len(bq) for bq in self._q)
        if len(qs) != want:
            raise ValueError("the checkpoint's PowerSGD state does not match these parameters")
        it = iter(qs)
        self._q = [[np.asarray(next(it), np.float32).reshape(q.shape).copy() for q in bq] for bq in self._q]


async def _ready(x: np.ndarray) -> np.ndarray:
    return x


def compression_from(text: str | None) -> Any:
    """A codec's name as it is, or a compressor from its description (``"topk:0.01"``,
    ``"powersgd:4"``: what ``psring train --compression`` takes); ValueError naming the forms."""
    if text is None or ":" not in text:
        return text
    kind, _, arg = text.partition(":")
    try:
        if kind == "topk":
            return TopK(float(arg))
        if kind == "powersgd":
            return PowerSGD(int(arg))
    except ValueError as exc:
        raise ValueError(f"compression {text!r}: {exc}") from None
    raise ValueError(f"compression {text!r} is not a codec ({', '.join(CODECS)}), topk:RATIO or powersgd:RANK")


__all__ = ["Compressor", "PowerSGD", "TopK", "compression_from"]
