"""How sparse tables' rows are laid out over the shards and packed on the wire (both sides).

Rows are sharded by contiguous range (``row_range``); a push or pull carries a shard's int64 row
indices, then the rows' bytes (``pack_rows``, ``pack_by_shard``, ``unpack_rows``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import ProtocolError


def row_range(num_rows: int, shards: int, s: int) -> tuple[int, int]:
    """Rows [a, b) of a num_rows table that shard s of shards holds."""
    return num_rows * s // shards, num_rows * (s + 1) // shards


def pack_rows(indices: np.ndarray, values: np.ndarray) -> np.ndarray:
    """One payload: the int64 indices, then the rows' bytes."""
    return np.concatenate(
        [indices.astype(np.int64).view(np.uint8), np.ascontiguousarray(values).reshape(-1).view(np.uint8)]
    )


def pack_by_shard(
    indices: np.ndarray, values: np.ndarray, num_rows: int, shards: int, pulls: list[np.ndarray] | None = None
) -> list[tuple[int, np.ndarray]]:
    """(rows, pack_rows payload) of each shard's share of int64 ``indices`` and 2-D ``values``, for
    shards 0..shards-1 (none where it has none), each row gathered once straight into its payload;
    a shard's rows keep the order they had (the merge adds them in it). Every index must lie in
    0..num_rows-1. ``pulls``: int64 indices to append to each shard's payload (rows to send back)."""
    width = values.shape[1]
    if shards == 1 and not pulls:
        return [(int(indices.size), pack_rows(indices, values))]
    bounds = np.array([row_range(num_rows, shards, s)[0] for s in range(1, shards)], np.int64)
    which = np.searchsorted(bounds, indices, side="right").astype(np.int16 if shards < 1 << 15 else np.int64)
    order = np.argsort(which, kind="stable")  # by shard, each shard's rows in their own order
    counts = np.bincount(which, minlength=shards)
    out, at = [], 0
    for s in range(shards):
        n = int(counts[s])
        sel = order[at : at + n]
        at += n
        body = n * 8 + n * width * values.itemsize
        extra = pulls[s] if pulls else indices[:0]
        payload = np.empty(body + extra.size * 8, np.uint8)
        np.take(indices, sel, out=payload[: n * 8].view(np.int64))
        np.take(values, sel, axis=0, out=payload[n * 8 : body].view(values.dtype).reshape(n, width))
        payload[body:].view(np.int64)[:] = extra
        out.append((n, payload))
    return out


def unpack_rows(
    payload: Any, count: int, width: int, dtype: np.dtype, owned: bool = True, pull: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(indices, rows, pull indices) of a pack_by_shard payload (``pull`` of them after the rows):
    views of it when the frame owns its buffer (a payload read from the socket), copies when it
    lies in a shared-memory slot given back after."""
    raw = np.frombuffer(payload, np.uint8)
    if not owned:
        raw = raw.copy()
    body = count * 8 + count * width * dtype.itemsize
    if raw.size != body + pull * 8:
        raise ProtocolError(
            f"sparse rows frame of {raw.size} bytes, expected {body + pull * 8} for {count} rows of {width}"
            f" and {pull} to pull"
        )
    return raw[: count * 8].view(np.int64), raw[count * 8 : body].view(dtype).reshape(count, width), raw[body:].view(
        np.int64
    )
