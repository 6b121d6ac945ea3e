"""How the parameter server splits collectives: which shard owns which slice, in pieces of what size.

Workers and shards compute this alike (every element is owned by exactly one shard) from the
call, the number of shards, and the job's shard weights and piece size, which every join names.
"""

from __future__ import annotations

from ...settings import MAX_WEIGHT

#: tensors up to this many bytes go whole to one shard (seq mod shards); larger ones are split over all
WHOLE_MAX_BYTES = 64 << 10

FOLD_KINDS = ("all_reduce", "reduce", "reduce_scatter")
RELAY_KINDS = ("broadcast", "all_gather", "gather")
KINDS = (*FOLD_KINDS, *RELAY_KINDS, "barrier", "scatter")
#: collectives whose pushes may travel in a worker's shared memory
SHARED_KINDS = (*FOLD_KINDS, *RELAY_KINDS)

#: the gid prefix of a group of an elastic job's live workers, followed by their ranks ("0.live.0.2")
LIVE = "0.live."


def live_gid(members: list[int]) -> str:
    return LIVE + ".".join(map(str, members))


def may_need(gid: str, rank: int) -> bool:
    """Whether a collective of group ``gid`` may need worker ``rank``: a group of an elastic job's live
    workers names them (``live_gid``); of any other group a shard cannot tell."""
    if gid.startswith(LIVE):
        try:
            return rank in {int(r) for r in gid[len(LIVE) :].split(".")}
        except ValueError:
            return True
    return True


#: the most shards a weighted plan may name (a join's word, bounded before use)
MAX_WEIGHTED_SHARDS = 4096


# ------------------------------------------------------------------ the plan
def plan(
    kind: str, n: int, itemsize: int, shards: int, seq: int, weights: tuple[int, ...] | None = None
) -> list[tuple[int, int, int]]:
    """Which shards take part in collective #seq, and the slice [a, b) of the flat tensor each owns.

    Tensors above WHOLE_MAX_BYTES are split into ``shards`` contiguous slices of equal
    size (balanced by bytes), so one huge tensor spreads over every server; with ``weights``
    (one positive whole number per shard, PSRING_PS_WEIGHTS) shard s's slice is weights[s] /
    sum(weights) of the tensor instead -- the BytePS split, more of every tensor on shards with
    more bandwidth to spare (which shard owns an element never changes its bits). Smaller
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
    if weights is None:
        return [(s, s * n // shards, (s + 1) * n // shards) for s in range(shards)]
    total, bounds, acc = sum(weights), [0], 0
    for w in weights:
        acc += w
        bounds.append(acc * n // total)
    return [(s, bounds[s], bounds[s + 1]) for s in range(shards) if bounds[s] < bounds[s + 1]]


def check_weights(weights: object, shards: int | None = None) -> tuple[int, ...]:
    """weights as a tuple, or a ValueError naming what is wrong (a count that is not the shards')."""
    if not (
        isinstance(weights, tuple | list)
        and 1 <= len(weights) <= MAX_WEIGHTED_SHARDS
        and all(type(w) is int and 1 <= w <= MAX_WEIGHT for w in weights)
    ):
        raise ValueError(
            f"shard weights {weights!r} are not 1 to {MAX_WEIGHTED_SHARDS} whole numbers from 1 to {MAX_WEIGHT}"
        )
    if shards is not None and len(weights) != shards:
        raise ValueError(f"{len(weights)} shard weights ({','.join(map(str, weights))}) for {shards} shards")
    return tuple(weights)


#: across hosts, a shard's slice of a collective goes in this many pieces (see piece_bytes;
#: PSRING_PS_WIRE_PIECES sets it; unset, :func:`link_tuning` picks it for the links a job measured)
WIRE_PIECES = 8
#: links up to this rate (bytes/s) are slow for the ps: a piece's CPU is small beside its time on the
#: wire, so smaller pieces pay (a shorter first and last piece)
SLOW_LINK = 2.5e9 / 8
SLOW_LINK_PIECES = 32
#: the send buffer of a ps's connections between hosts on links up to SNDBUF_LINK_MAX whose
#: bandwidth-delay product it covers four times over (it caps a connection at the buffer / the round trip)
SNDBUF = 128 << 10
SNDBUF_LINK_MAX = 10e9 / 8


def link_tuning(rate: float, round_trip: float) -> tuple[int, int]:
    """(pieces a shard's slice, the send buffer; 0: the kernel sizes it) for a ps whose workers reach
    shards on other hosts over links of ``rate`` bytes/s each way and ``round_trip`` seconds.

    With the kernel's send buffers (up to 4 MiB) the flows that share a link -- a worker's pushes to
    its shards, the workers' pushes into a shard -- take uneven shares, and a shard waits for the
    slowest worker's piece while its link out idles; small buffers keep them even, where they still
    cover the link's bandwidth-delay product. More pieces a slice let a shard answer sooner, and cost
    CPU each: they pay on slow links only. The runs: docs/defaults.md#parameter-server. The one rule
    for both a job's own choice (its set-up probe) and ``psring advise``'s."""
    pieces = SLOW_LINK_PIECES if rate <= SLOW_LINK else WIRE_PIECES
    sndbuf = SNDBUF if rate <= SNDBUF_LINK_MAX and 4 * round_trip * rate <= SNDBUF else 0
    return pieces, sndbuf


def piece_bytes(
    nbytes: int, shards: int, piece: int, wire_piece: int, across_hosts: bool, wire_pieces: int = WIRE_PIECES
) -> int:
    """The piece of a collective of nbytes: ``piece`` (PSRING_PS_PIECE); when some worker reaches a shard
    on another host, small enough that each shard's slice is ``wire_pieces`` pieces, but not below
    ``wire_piece`` (PSRING_PS_WIRE_PIECE; 0: off). A shard folds and answers a piece only once every
    worker's copy is in, so a slice of one piece would cross a link twice in a row (pushes, then
    results); much smaller pieces cost CPU each (the runs: docs/defaults.md#parameter-server)."""
    if not (across_hosts and 0 < wire_piece < piece):
        return piece
    return min(piece, max(wire_piece, nbytes // max(shards, 1) // max(wire_pieces, 1)))


def per_piece(itemsize: int, piece_bytes: int) -> int:
    """Elements per piece (PSRING_PS_PIECE bytes; workers and servers must agree on it)."""
    return max(1, piece_bytes // max(itemsize, 1))
