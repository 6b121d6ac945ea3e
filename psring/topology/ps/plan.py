"""How the parameter server splits collectives: which shard owns which slice, in pieces of what size.

Workers and shards compute this alike (every element is owned by exactly one shard), so
neither has to tell the other.
"""

from __future__ import annotations

#: tensors up to this many bytes go whole to one shard (seq mod shards); larger ones are split over all
WHOLE_MAX_BYTES = 64 << 10

FOLD_KINDS = ("all_reduce", "reduce", "reduce_scatter")
RELAY_KINDS = ("broadcast", "all_gather", "gather")
KINDS = (*FOLD_KINDS, *RELAY_KINDS, "barrier", "scatter")
#: collectives whose pushes may travel in a worker's shared memory
SHARED_KINDS = (*FOLD_KINDS, *RELAY_KINDS)


# ------------------------------------------------------------------ the plan
def plan(kind: str, n: int, itemsize: int, shards: int, seq: int) -> list[tuple[int, int, int]]:
    """Which shards take part in collective #seq, and the slice [a, b) of the flat tensor each owns.

    Tensors above WHOLE_MAX_BYTES are split into ``shards`` contiguous slices of equal
    size (balanced by bytes), so one huge tensor spreads over every server. Smaller
    ones, barriers and empty tensors go whole to one shard, ``seq % shards``, so
    consecutive small collectives spread over the servers too. Scatter involves
    every shard (row r travels through shard r % shards). Workers and shards compute
    this alike; every element is owned by exactly one shard.
    """
    if kind == "scatter":
        return [(s, 0, 0) for s in range(shards)]
    if kind == "barrier":
        return [(seq % shards, 0, 0)]
    if n * itemsize <= WHOLE_MAX_BYTES or n < shards:
        return [(seq % shards, 0, n)]
    return [(s, s * n // shards, (s + 1) * n // shards) for s in range(shards)]


def per_piece(itemsize: int, piece_bytes: int) -> int:
    """Elements per piece (PSRING_PS_PIECE bytes; workers and servers must agree on it)."""
    return max(1, piece_bytes // max(itemsize, 1))
