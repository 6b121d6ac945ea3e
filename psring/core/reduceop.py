"""Reduce ops as objects: what a fold does with two operands, and what it does once at the end.

Calls name their op by a string (``op="avg"``: the public API and every frame's call descriptor
carry the name); what folds, the ring's passes, the shards and the boards use is the
:class:`ReduceOp` that name stands for -- its ufunc, the op a partial fold runs (``avg``'s partial
sums are sums), whether the result is then divided by the number of ranks, and which dtypes it
takes. A new op is a new entry in :data:`OPS` (and, where the C folds should run it, a letter in
``psring/native/fold.c``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .arrays import dtype_name


@dataclass(frozen=True, eq=False)
class ReduceOp:
    """One reduction (see the module's docstring)."""

    name: str
    #: the elementwise operation of a fold step
    ufunc: np.ufunc
    #: divide by the number of ranks once the fold is done (avg)
    mean: bool = False

    @property
    def partial(self) -> str:
        """The op a partial fold runs (a host's, a level's): avg's partial sums are sums."""
        return "sum" if self.mean else self.name

    def finish(self, acc: np.ndarray, n_ranks: int) -> None:
        """What happens once, after the last fold step (avg: divide by the number of ranks)."""
        if self.mean:
            np.divide(acc, acc.dtype.type(n_ranks), out=acc)

    def check(self, dtype: np.dtype) -> None:
        """Refuse, naming it, a dtype this op is not defined on (avg of integers)."""
        if self.mean and dtype.kind not in "fV" and dtype_name(dtype) != "bfloat16":
            raise TypeError(f"op={self.name!r} needs a floating dtype, got {dtype}; use op='sum' and divide")

    def __repr__(self) -> str:
        return f"ReduceOp({self.name!r})"


SUM = ReduceOp("sum", np.add)
AVG = ReduceOp("avg", np.add, mean=True)
PROD = ReduceOp("prod", np.multiply)
MIN = ReduceOp("min", np.minimum)
MAX = ReduceOp("max", np.maximum)
#: the reduce ops every collective takes, by name
OPS: dict[str, ReduceOp] = {o.name: o for o in (SUM, AVG, MIN, MAX, PROD)}


def op_named(op: str | ReduceOp) -> ReduceOp:
    """The ReduceOp ``op`` names; a ValueError naming the choices otherwise."""
    if isinstance(op, ReduceOp):
        return op
    found = OPS.get(op) if isinstance(op, str) else None
    if found is None:
        raise ValueError(f"op={op!r} is not one of {', '.join(OPS)}")
    return found


__all__ = ["AVG", "MAX", "MIN", "OPS", "PROD", "SUM", "ReduceOp", "op_named"]
