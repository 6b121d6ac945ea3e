"""fp16 compression for all_reduce: float16 on the wire, float32 arithmetic, one canonical result.

The arithmetic of :class:`psring.core.codec.Fp16` (what the ring, the shards and SyncSGD are
handed); the rules:

Every rank first agrees on one power-of-two scale 2**e (from the largest magnitude
on any rank, so that a sum over all ranks stays below 2**15 and no partial sum can
overflow float16). Then:

- a rank's contribution is ``q = fp16(x * 2**e)``; it counts as ``x' = q / 2**e``;
- element i in ring chunk c is folded, in float32, in the canonical order
  ``((x'_c + x'_c+1) + ...) + x'_c-1``, and every partial sum is rounded through
  float16 on its way (exactly what travels between ring neighbours);
- the final sum (divided by N for avg) is rounded through float16 once more: that is
  what every rank receives.

Because the scale is a power of two, scaling is exact and rounding happens only at
the float16 casts, element by element: a parameter-server shard that folds the
workers' float16 pieces with :func:`fold_fp16` gets the very bits the ring gets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..errors import ProtocolError
from .fold import ring_chunk_bounds
from .reduceop import OPS

#: partial sums are kept below this (float16's largest finite value is 65504)
_CEILING = 2.0**15
#: scale exponents outside +-this are refused (2**100 keeps float32 products finite)
MAX_EXP = 100


def scale_exponent(amax: float, n_ranks: int) -> int:
    """e such that n_ranks * amax * 2**e <= 2**15 (0 for zero or non-finite amax)."""
    if not math.isfinite(amax) or amax <= 0.0:
        return 0
    e = math.floor(math.log2(_CEILING / (n_ranks * amax)))
    return max(-MAX_EXP, min(MAX_EXP, e))


def parse_codec_op(op: object) -> tuple[str, int] | None:
    """(base op, scale exponent) of an fp16 call's op field, None for a plain op; ProtocolError if
    malformed. (psring.core.codec.parse_descriptor reads any codec's.)"""
    if not isinstance(op, str) or ":" not in op:
        return None
    base, _, rest = op.partition(":")
    codec, _, exp = rest.partition("@")
    try:
        e = int(exp)
    except ValueError:
        e = None
    if base not in ("sum", "avg") or codec != "fp16" or e is None or not -MAX_EXP <= e <= MAX_EXP:
        raise ProtocolError(f"op {op!r} is not a valid compressed reduction (like 'avg:fp16@12')")
    return base, e


def quantize(x: np.ndarray, e: int, out: np.ndarray | None = None) -> np.ndarray:
    """fp16(x * 2**e), rounded once (the float32 product is exact)."""
    if out is None:
        out = np.empty(x.shape, np.float16)
    np.multiply(x, np.float32(2.0**e), out=out)  # computed in float32, cast to float16 once
    return out


def dequantize(q: np.ndarray, e: int, out: np.ndarray | None = None) -> np.ndarray:
    """float32(q) / 2**e, exactly."""
    if out is None:
        out = np.empty(q.shape, np.float32)
    np.multiply(q, np.float32(2.0**-e), out=out, dtype=np.float32)
    return out


def fold_fp16(
    parts: Sequence[np.ndarray] | np.ndarray,
    op: str,
    e: int,
    out: np.ndarray,
    offset: int = 0,
    total: int | None = None,
) -> np.ndarray:
    """Fold the ranks' float16 pieces parts[0..N-1] into out (float16) as the ring does.

    The pieces may be a window [offset, offset + out.size) of a tensor of ``total``
    elements; the ring chunks are those of the whole tensor.
    """

    n_ranks = len(parts)
    lo, hi = offset, offset + out.size
    for c, (a, b) in enumerate(ring_chunk_bounds(out.size if total is None else total, n_ranks)):
        a, b = max(a, lo) - lo, min(b, hi) - lo
        if a >= b:
            continue
        acc = dequantize(parts[c][a:b], e)
        for k in range(1, n_ranks):
            np.add(acc, dequantize(parts[(c + k) % n_ranks][a:b], e), out=acc)
            if k < n_ranks - 1:
                dequantize(quantize(acc, e), e, out=acc)  # what the next ring hop receives
        OPS[op].finish(acc, n_ranks)
        quantize(acc, e, out=out[a:b])
    return out
