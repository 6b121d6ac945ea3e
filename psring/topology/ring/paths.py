"""Which path a ring reduction takes: one pure decision over thresholds every rank agreed.

Every rank of a call must take the same path, or each waits on frames the others never
send. So the decision depends only on what is the same everywhere: the call (its size,
the group's size, whether it is the job's whole group, compression) and a frozen
:class:`RingPaths` built once at set-up from the agreed settings (PeerNet.resolve agrees
PSRING_RING_ROOTED_MIN, the data plane's thresholds and the host layout). Nothing here
sees a socket; ``tests/topology/test_ring_paths.py`` checks the table alone, and docs/design.md
prints it (:func:`describe`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: tensors up to this many bytes take a one-hop path (every rank's tensor goes where it is folded)
#: instead of the pipelined ring; also the largest payload the same-host Unix links carry
SMALL_BYTES = 64 << 10

#: "never": a threshold no tensor reaches
NEVER = 1 << 62

#: the largest ring chunk (bytes, ceil(size / N)) the two-hop all_reduce sends as one message on a TCP
#: small-message link (psring.transport.tcpmesh.MAX_PAYLOAD holds it and a dtype's bytes more)
TWO_HOP_CHUNK_MAX = 1 << 20
#: and the fewest ranks it is for: at 3 the ring waits 4 times a call, not 6, and two hops were no faster
#: (docs/defaults.md#two-hops)
TWO_HOP_RANKS = 4
#: ... but for a pair of ranks, where two hops wait as often as the ring (twice) and the native call on
#: the caller's thread is what makes them faster: above the one-hop sizes up to this size, where the
#: data plane takes over (docs/defaults.md#two-hops)
PAIR_TWO_HOP_MAX = 1536 << 10


class Path(enum.Enum):
    """The ways the ring reduces a tensor (all give the canonical fold's bits): each is one algorithm
    (ring.chooser), and a trace or ``psring advise`` names a call's route by it."""

    #: every rank of one host posts its tensor on its shared-memory board and folds every post (or its
    #: ring chunk of them, then gathers the others' folded chunks)
    BOARD = "board"
    #: the same through the boards' slots a block at a time, in C on the board's thread (large calls)
    STREAMED = "streamed"
    #: every rank sends its whole tensor to every rank (or to dst) and folds: one hop, N(N-1) frames
    DIRECT = "direct"
    #: every rank sends to the call's root (seq mod N), which folds and sends the result back: 2(N-1) frames
    ROOTED = "rooted"
    #: pipelined reduce-scatter then all-gather over the ring links, on the event loop
    RING = "ring"
    #: the same schedule on the threaded data plane (its own sockets or shared memory)
    PLANE = "plane"
    #: reduce within each host, ring across hosts, spread within the host again
    HIERARCHICAL = "hierarchical"
    #: between hosts, on the TCP small-message links: every rank sends ring chunk d of its tensor to rank
    #: d, which folds it; then every rank sends its folded chunk to every rank: 2(N-1) messages a rank
    TWO_HOP = "two_hop"


@dataclass(frozen=True)
class RingPaths:
    """The agreed thresholds a job's ranks decide paths by (the same object on every rank)."""

    #: group size from which small calls go through a root (PSRING_RING_ROOTED_MIN, agreed: the largest)
    rooted_min: int = NEVER
    #: all_reduces of the job's group from this many bytes take the data plane (NEVER: no plane)
    plane_min: int = NEVER
    #: the job's group reduces in two levels (the ranks' hosts make a layout, nobody turned it off)
    hierarchical: bool = False
    small_bytes: int = SMALL_BYTES
    #: all_reduces of the job's group from two_hop_min up to two_hop_max bytes take two hops over the TCP
    #: small-message links (one-hop sizes too: two messages of a chunk each beat one of the whole tensor to
    #: every peer from a few dozen KiB), from 4 ranks (PSRING_RING_TWO_HOP_MIN, PSRING_RING_TWO_HOP,
    #: agreed: the largest minimum, the smallest maximum; a maximum of 0: never)
    two_hop_min: int = NEVER
    two_hop_max: int = 0

    def two_hop(self, nbytes: int, n_ranks: int) -> bool:
        if n_ranks == 2:
            return max(self.two_hop_min, self.small_bytes + 1) <= nbytes <= min(self.two_hop_max, PAIR_TWO_HOP_MAX)
        return (
            n_ranks >= TWO_HOP_RANKS
            and self.two_hop_min <= nbytes <= self.two_hop_max
            and -(-nbytes // n_ranks) <= TWO_HOP_CHUNK_MAX
        )

    def small(self, nbytes: int, n_ranks: int) -> bool:
        return n_ranks == 1 or nbytes <= self.small_bytes

    def one_hop(self, n_ranks: int, *, to_all: bool = True) -> Path:
        """The one-hop path of a small reduction: ROOTED when its result goes to every rank and the
        group is large enough, else DIRECT."""
        return Path.ROOTED if to_all and n_ranks >= self.rooted_min else Path.DIRECT


def choose_all_reduce(
    nbytes: int, n_ranks: int, paths: RingPaths, *, world: bool = True, coded: bool = False, plane_up: bool = True
) -> Path:
    """The path of an all_reduce of ``nbytes`` over ``n_ranks`` ranks.

    ``world``: the call is on the job's whole group (subgroups have no plane and no host layout).
    ``coded``: a codec on the wire (the compressed ring: never the plane or the two levels).
    ``plane_up``: this rank's data plane is running (it is on every rank once set up; a closed one
    means the group is broken anyway).
    """
    if coded:
        return paths.one_hop(n_ranks) if paths.small(nbytes, n_ranks) else Path.RING
    if world and paths.hierarchical and n_ranks > 1:
        return paths.one_hop(n_ranks) if nbytes <= paths.small_bytes else Path.HIERARCHICAL
    if world and paths.two_hop(nbytes, n_ranks):
        return Path.TWO_HOP
    if world and plane_up and n_ranks > 1 and nbytes >= paths.plane_min:
        return Path.PLANE
    return paths.one_hop(n_ranks) if paths.small(nbytes, n_ranks) else Path.RING


def choose_reduce(nbytes: int, n_ranks: int, paths: RingPaths, *, to_all: bool) -> Path:
    """The path of a reduce_scatter (``to_all``: every rank gets its slice of the fold) or a reduce to one
    rank: a one-hop path when small, else the pipelined ring."""
    return paths.one_hop(n_ranks, to_all=to_all) if paths.small(nbytes, n_ranks) else Path.RING


def describe(paths: RingPaths) -> list[str]:
    """The decision as lines a person reads (docs/design.md, ``psring advise``)."""
    rooted = "never" if paths.rooted_min >= NEVER else f"from {paths.rooted_min} ranks"
    plane = "off" if paths.plane_min >= NEVER else f"from {paths.plane_min} bytes"
    return [
        f"all_reduce up to {paths.small_bytes} bytes: one hop (through a rotating root {rooted}, else direct)",
        "all_reduce of the job's group across hosts: hierarchical" if paths.hierarchical else "hosts: one level",
        (
            f"all_reduce of the job's group of {TWO_HOP_RANKS} ranks or more from "
            f"{paths.two_hop_min} bytes up to {paths.two_hop_max} (a ring chunk up to "
            f"{TWO_HOP_CHUNK_MAX}), of 2 ranks from {max(paths.two_hop_min, paths.small_bytes + 1)} up to "
            f"{min(paths.two_hop_max, PAIR_TWO_HOP_MAX)}: two hops over the TCP small-message links"
            if paths.two_hop_max
            else "two hops over the TCP small-message links: off"
        ),
        f"all_reduce of the job's group on the threaded data plane {plane}",
        "every other all_reduce: the pipelined ring on the event loop; a codec on the wire: never the plane",
    ]
