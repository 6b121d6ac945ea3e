"""What the ring's modules share: the phases in data tags, and fixed bounds and graces.

The tunable sizes and thresholds are settings (psring.settings: PSRING_RING_*).
"""

from __future__ import annotations

from .paths import SMALL_BYTES

# phases in data tags: (gid, seq, phase, ...)
RS, AG, DIRECT, BCAST, GATHER_RING, TO_ROOT, SCATTER, RESULT = range(8)
#: the two-hop all_reduce's (ring.twohop): every rank's chunk d to rank d, then every folded chunk to all
TWO_SCATTER, TWO_GATHER = 8, 9

#: seconds a rank that waits only on the root of a rooted call gives the root to name the silent
#: rank before its own timeout names the root
ROOT_REPORT_GRACE = 1.0

#: the largest payload that takes the same-host links (the rest of a message is its header): what the
#: one-hop paths send (ring.paths.SMALL_BYTES), one number under the name each side reads it by
MESH_MAX_BYTES = SMALL_BYTES
#: messages that may wait for a collective (or subgroup) this rank has not reached yet
MESH_EARLY_MAX = 100_000

#: seconds a broken data link waits for the control plane to report the same loss (with its reason)
PLANE_GRACE = 1.0

#: hierarchical all_reduce (ring.hier): phases HIER + 4·block + step; bytes per block; blocks in flight
HIER = 16
HIER_BLOCK = 4 << 20
HIER_DEPTH = 4

#: phases of same-host messages about the boards (psring.topology.ring.board): a wake-up for a rank asleep
#: on one, and a rank's call, told to the peers it waits on (so that another call there is a mismatch now)
BOARD_WAKE = 99
BOARD_HERE = 98
