"""psring._native's fold kernel (psring/native/fold.c) called directly through ``fold_chunk``: every
(kind, op) it folds against numpy's one IEEE operation at a time, rows of every length (the vector
loops' ends), the chunk's own row taken from ``own``, and the result written in place of a row."""

from __future__ import annotations

import numpy as np
import pytest

native = pytest.importorskip("psring._native", reason="the C extension is not built here")

KINDS = {"f": np.float32, "d": np.float64, "i": np.int32, "I": np.uint32, "q": np.int64, "Q": np.uint64}


def _reference(rows: np.ndarray, first: int, own: np.ndarray, op: str) -> np.ndarray:
    """rows[first] (= own), rows[first + 1], ... rows[first - 1] folded left to right, as numpy would."""
    n = len(rows)
    acc = own.copy()
    for j in range(1, n):
        r = rows[(first + j) % n]
        acc = acc * r if op == "prod" else acc + r
    if op == "avg":
        acc = acc / acc.dtype.type(n)
    return acc


#: every (kind, op) the kernel folds: avg is for floats only (psring.core.fold.check_op; the refusal of an
#: integer avg is tested below)
KIND_OPS = [(k, op) for k in sorted(KINDS) for op in ("sum", "avg", "prod") if op != "avg" or k in "fd"]


@pytest.mark.parametrize(("kind", "op"), KIND_OPS)
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("count", [1, 7, 64, 1027])
def test_fold_chunk_gives_numpys_bits(kind: str, op: str, n: int, count: int) -> None:
    dtype = KINDS[kind]
    rng = np.random.default_rng(n * 1000 + count)
    if kind in "fd":
        rows = rng.standard_normal((n, count)).astype(dtype)
    else:
        rows = rng.integers(-(1 << 20), 1 << 20, (n, count)).astype(dtype)  # products wrap, as numpy's
    first = n // 2
    own = rows[first].copy()
    rows[first] = 0  # the fold reads this rank's own row from `own`, never from rows
    out = np.full(count, 7, dtype)
    with np.errstate(over="ignore"):
        native.fold_chunk(rows, first, out, kind, op, own)
        rows[first] = own
        want = _reference(rows, first, own, op)
    assert out.tobytes() == want.tobytes()


def test_fold_chunk_refuses_what_does_not_fit() -> None:
    rows = np.zeros((3, 8), np.float32)
    with pytest.raises(ValueError, match="fold_chunk"):  # an empty chunk: the caller folds nothing
        native.fold_chunk(np.zeros((3, 0), np.float32), 0, np.zeros(0, np.float32), "f", "sum", np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="fold_chunk"):  # avg of integers
        native.fold_chunk(np.zeros((3, 8), np.int32), 0, np.zeros(8, np.int32), "i", "avg", np.zeros(8, np.int32))
    with pytest.raises((ValueError, TypeError)):
        native.fold_chunk(rows, 0, np.zeros(9, np.float32), "f", "sum", np.zeros(8, np.float32))  # out too long
    with pytest.raises((ValueError, TypeError)):
        native.fold_chunk(rows, 3, np.zeros(8, np.float32), "f", "sum", np.zeros(8, np.float32))  # no rank 3
