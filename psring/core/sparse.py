"""SparseRows: some rows of a table (an embedding's gradient: the rows a batch touched).

``SparseRows(indices, values, num_rows)``: ``indices`` a 1-D integer array (duplicates allowed),
``values`` the matching rows, shape ``(len(indices), width)``, ``num_rows`` the table's height.
numpy or cupy (both arrays on one device). ``merge_rows`` is the one way rows are summed: every
rank's rows concatenated in rank order, a stable sort by index, and each index's rows added in
that order -- the same bits wherever it runs.

Knows arrays, not groups.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import array_module, check_array


class SparseRows:
    """Rows ``indices`` of a ``num_rows`` x width table, with their ``values``."""

    __slots__ = ("indices", "num_rows", "values")

    def __init__(self, indices: Any, values: Any, num_rows: int) -> None:
        indices = check_array(indices, "indices")
        values = check_array(values, "values")
        if array_module(indices) is not array_module(values):
            raise TypeError("SparseRows: indices and values must be on one device (both numpy or both cupy)")
        if indices.ndim != 1 or indices.dtype.kind not in "iu":
            raise TypeError(f"SparseRows: indices must be a 1-D integer array, got {indices.dtype} {indices.shape}")
        if values.ndim != 2 or values.shape[0] != indices.shape[0]:
            raise ValueError(
                f"SparseRows: values must have shape (len(indices), width) = ({indices.shape[0]}, width), "
                f"got {values.shape}"
            )
        if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)) or num_rows < 1:
            raise ValueError(f"SparseRows: num_rows must be a positive integer, got {num_rows!r}")
        self.indices = indices.astype(np.int64, copy=False)
        self.values = values
        self.num_rows = int(num_rows)

    @property
    def width(self) -> int:
        return int(self.values.shape[1])

    def problem(self) -> str | None:
        """What is wrong with the indices (one outside 0..num_rows-1), or None."""
        if self.indices.size == 0:
            return None
        lo, hi = int(self.indices.min()), int(self.indices.max())
        if lo < 0 or hi >= self.num_rows:
            bad = lo if lo < 0 else hi
            return f"index {bad} is outside the table's rows 0..{self.num_rows - 1}"
        return None

    def to_dense(self) -> Any:
        """The table these rows make with zeros elsewhere (duplicates summed, as merge_rows does)."""
        xp = array_module(self.values)
        host = merge_rows([(_host(self.indices), _host(self.values))], self.num_rows, self.width, self.values.dtype)
        dense = np.zeros((self.num_rows, self.width), self.values.dtype)
        dense[host.indices] = host.values
        return dense if xp is np else xp.asarray(dense)

    def __repr__(self) -> str:
        return f"SparseRows({self.indices.shape[0]} rows of {self.num_rows} x {self.width}, {self.values.dtype})"


def _host(x: Any) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.get()


def merge_rows(parts: list[tuple[np.ndarray, np.ndarray]], num_rows: int, width: int, dtype: Any) -> SparseRows:
    """(indices, values) of every rank, in rank order -> unique sorted indices, rows summed in
    that order (rank, then position within the rank)."""
    if len(parts) == 1:
        idx, val = parts[0][0], parts[0][1].reshape(-1, width)  # only read: gathered from below
    elif parts:
        idx = np.concatenate([i for i, _ in parts])
        val = np.concatenate([v.reshape(-1, width) for _, v in parts])
    else:
        idx, val = np.empty(0, np.int64), np.empty((0, width), dtype)
    if idx.size == 0:
        return SparseRows(idx.astype(np.int64), val.astype(dtype, copy=False), num_rows)
    order = np.argsort(idx, kind="stable")
    sorted_idx = idx[order]
    head = np.empty(sorted_idx.size, bool)  # where a new index begins (the rows stay where they are:
    head[0] = True  # each is gathered once, by its place in ``order``, not sorted first)
    np.not_equal(sorted_idx[1:], sorted_idx[:-1], out=head[1:])
    starts = np.flatnonzero(head)
    unique = sorted_idx[starts]
    counts = np.diff(np.append(starts, sorted_idx.size))
    # each index's rows added one after another in that order, vectorized over indices: round k
    # adds every index's k-th row (the same bits on every rank, and the order the docs promise)
    out = np.take(val, order[starts], axis=0)  # a new array (take: 3x fancy indexing's speed)
    if out.dtype != dtype:
        out = out.astype(dtype)
    for k in range(1, int(counts.max())):
        more = counts > k
        out[more] += np.take(val, order[starts[more] + k], axis=0)
    return SparseRows(unique, out, num_rows)
