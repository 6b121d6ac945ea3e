"""The canonical reduction order every topology reproduces, bit for bit.

Split the flattened tensor into N ring chunks; element i of a sum or product is the
left fold over ranks starting at the rank c whose chunk holds i:
((x_c op x_c+1) op ...) op x_c-1, ranks mod N (avg: that sum divided by N). The ring
computes this naturally; parameter-server shards and the one-hop small-message paths
fold in the same order, so every path and topology returns the same bits.

Across hosts (several hosts, several ranks on each) all_reduce follows a second, two-level
order instead, the one a hierarchical all-reduce computes with the fewest bytes between
hosts: element i is the left fold over hosts (in the order of their lowest rank) of each
host's left fold over its own ranks (in rank order): (P_0 op P_1) op ..., P_h =
(x_h0 op x_h1) op .... The ring's hierarchical path, its small-message path and the
parameter server's shards all fold in it when the ranks' layout (:func:`host_layout`) calls
for it. Unlike the flat order it does not depend on where chunk boundaries fall.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from .reduceop import OPS, op_named


def ring_chunk_bounds(n: int, world_size: int) -> list[tuple[int, int]]:
    """Split n elements into world_size contiguous ring chunks (the canonical split)."""
    return [(c * n // world_size, (c + 1) * n // world_size) for c in range(world_size)]


#: ranks grouped by host: hosts in the order of their lowest rank, each host's ranks ascending
Layout = tuple[tuple[int, ...], ...]


def host_layout(keys: Sequence[str | None]) -> Layout | None:
    """The hosts of ranks 0..N-1 from their host keys, when the two-level order applies: every rank
    told its host, there are two hosts or more, and each holds the same number of ranks, two or more.
    Else None (the flat order)."""
    if not keys or any(k is None for k in keys):
        return None
    groups: dict[str, list[int]] = {}
    for r, key in enumerate(keys):
        assert key is not None
        groups.setdefault(key, []).append(r)
    hosts = tuple(tuple(g) for g in groups.values())  # in order of each host's lowest rank already
    sizes = {len(h) for h in hosts}
    if len(hosts) < 2 or len(sizes) != 1 or min(sizes) < 2:
        return None
    return hosts


def two_level_fold(parts: Sequence[np.ndarray] | np.ndarray, op: str, out: np.ndarray, hosts: Layout) -> np.ndarray:
    """Reduce parts[0..N-1] into out in the two-level order (see the module's docstring)."""
    ufunc = reduce_op(op)
    partial: np.ndarray | None = None
    for k, host in enumerate(hosts):
        if k == 0:
            acc = out
        else:
            partial = acc = np.empty_like(out) if partial is None else partial
        fold_rows([parts[r] for r in host], ufunc, acc)
        if k:
            ufunc(out, acc, out=out)
    OPS[op].finish(out, sum(len(h) for h in hosts))
    return out


def fold_rows(rows: Sequence[np.ndarray], ufunc: np.ufunc, out: np.ndarray) -> np.ndarray:
    """The left fold of rows into out: ((rows[0] op rows[1]) op ...)."""
    if len(rows) == 1:
        out[...] = rows[0]
        return out
    ufunc(rows[0], rows[1], out=out)
    for row in rows[2:]:
        ufunc(out, row, out=out)
    return out


def reduce_op(op: str) -> np.ufunc:
    return OPS[op].ufunc


def canonical_fold(
    parts: Sequence[np.ndarray] | np.ndarray,
    op: str,
    out: np.ndarray,
    offset: int = 0,
    total: int | None = None,
    hosts: Layout | None = None,
) -> np.ndarray:
    """Reduce flat arrays parts[0..N-1] into out in the canonical order.

    Element i in ring chunk c is ((x_c op x_c+1) op ...) op x_c-1 (ranks mod N); for
    avg the sum is then divided by N. Every topology reproduces exactly this. The
    arrays may hold a window [offset, offset + out.size) of a flat tensor of ``total``
    elements (a parameter-server slice): the ring chunks are those of the whole tensor.
    With ``hosts`` (a :func:`host_layout`), the two-level order instead.
    """
    if hosts is not None:
        return two_level_fold(parts, op, out, hosts)
    n_ranks = len(parts)
    ufunc = reduce_op(op)
    if out.size == 1 and total is None and offset == 0 and n_ranks > 1:
        # one element (a 4-byte all_reduce): it lies in the last ring chunk, N-1, so the order is
        # x_N-1, x_0, x_1, ..., x_N-2 -- a few ufunc calls instead of the general path's set-up
        ufunc(parts[n_ranks - 1], parts[0], out=out)
        for k in range(1, n_ranks - 1):
            ufunc(out, parts[k], out=out)
        OPS[op].finish(out, n_ranks)
        return out
    if (
        not isinstance(parts, np.ndarray)
        and total is None
        and n_ranks >= 3
        and 0 < out.size <= _STACK_FOLD
        and len(_chunks_in(out.size, n_ranks, offset, offset + out.size)) > 1
    ):
        parts = np.stack(parts)  # separate small rows (a board's views): the gather path beats N chunk loops
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
        OPS[op].finish(out, n_ranks)
        return out
    size = out.size
    for c, a, b in _chunks_in(size if total is None else total, n_ranks, offset, offset + size):
        if a == 0 and b == size:  # one chunk holds the whole window (small calls): no slicing
            acc, rows = out, [parts[(c + k) % n_ranks] for k in range(n_ranks)]
        else:
            acc, rows = out[a:b], [parts[(c + k) % n_ranks][a:b] for k in range(n_ranks)]
        fold_rows(rows, ufunc, acc)  # no copy of the first operand first
    OPS[op].finish(out, n_ranks)
    return out


@functools.lru_cache(maxsize=256)
def _chunks_in(total: int, n_ranks: int, lo: int, hi: int) -> tuple[tuple[int, int, int], ...]:
    """(c, a, b) for each ring chunk c of a ``total``-element tensor that meets the window [lo, hi),
    a and b relative to lo (a call's plan: the same for every call of one size)."""
    chunks = []
    for c, (a, b) in enumerate(ring_chunk_bounds(total, n_ranks)):
        a, b = max(a, lo) - lo, min(b, hi) - lo
        if a < b:
            chunks.append((c, a, b))
    return tuple(chunks)


#: separate rows of up to this many elements are stacked for one fold, from 3 ranks: one fold of a
#: stack beats several small ones below it (docs/defaults.md#the-fold)
_STACK_FOLD = 1024
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


def finish_avg(acc: np.ndarray, n_ranks: int) -> None:
    """avg's last step (ReduceOp.finish of AVG)."""
    OPS["avg"].finish(acc, n_ranks)


def check_op(op: str, dtype: np.dtype) -> None:
    """Refuse an op that is not one (ValueError) or a dtype it is not defined on (TypeError)."""
    op_named(op).check(dtype)


def pieces(a: int, b: int, per_piece: int) -> list[tuple[int, int]]:
    """Split [a, b) into pieces of at most per_piece elements."""
    return [(s, min(s + per_piece, b)) for s in range(a, b, per_piece)]
