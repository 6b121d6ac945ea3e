"""``psring advise``: which topology to run, from a cost model of one training step's all-reduces.

The model (its assumptions, in the order they matter):

- Every host has one full-duplex link of ``bandwidth`` bytes/s each way to a switch that is never
  the bottleneck; a message between hosts costs ``latency`` seconds before its bytes flow. Ranks of
  one host reach each other through shared memory at ``local_bandwidth``.
- A step's communication is one all-reduce per tensor (psring buckets small tensors: give the
  bucket sizes with ``--sizes`` if you want them counted so); tensors go one after another.
- Each topology's time for ``S`` bytes is latency steps times ``latency`` plus the bytes the
  busiest link carries in one direction over ``bandwidth``:

  ========================  =====================  ===============================================
  topology                  latency steps          bytes on the busiest link, one direction
  ========================  =====================  ===============================================
  flat ring                 2(N-1)                 2(N-1)/N S (one ring edge leaves each host)
  flat ring, two hops       2                      2R(H-1)/H S (every rank's chunks to every other
  (N >= 4 or N = 2, from                           rank, then the folded chunks back: R = 1, the
  PSRING_RING_TWO_HOP_MIN                          ring's bytes); the sizes psring sends so
  to PSRING_RING_TWO_HOP)
  hierarchical ring (R>1)   2(H-1) + 2(R-1) local  2(H-1)/H S, plus 2(R-1)/R S through memory (up to
                                                   64 KiB psring sends it one hop, as the flat ring:
                                                   the flat ring's line)
  ps, shards colocated      2, and 2N messages     2(H-1)/H S (pushes out, other hosts' pulls out),
                                                   plus 2(R-1)/R S through memory (R > 1: below)
  ps, k dedicated hosts     2, and 2N messages     max(S, H S / k) (hosts push and pull S each),
                                                   with the fill and the drain (below)
  BytePS split              2, and 2N messages     a share x on the k dedicated hosts (the rest
                                                   colocated), the x that is fastest with a link
                                                   shared fairly by its flows (split_time: not the
                                                   x that evens the links' bytes), fill and drain
                                                   (PSRING_PS_WEIGHTS: split_weights)
  ========================  =====================  ===============================================

  with N workers on H hosts, R per host. A latency step costs ``latency`` plus ``per_message`` (a
  process's CPU time per message); a shard handles the N pushes and N pulls of its piece one after
  another (2N ``per_message``). Pushes and pulls of successive pieces overlap (the ps pipelines a
  tensor's pieces), so a direction's bytes, not their sum, set the time -- but for the first and the
  last piece: a shard answers a piece only once every worker's copy is in, so its link out idles
  until the first piece came in from every worker on another host (``fill``), and after the bytes
  its link still sends the last piece to each of them (``drain``): each those workers x the piece /
  bandwidth, pieces as psring cuts them across hosts, 8 per shard's slice between
  PSRING_PS_WIRE_PIECE and PSRING_PS_PIECE (both seen on the hosts bed, in the byte counters of a
  server host's link: docs/performance-history.md, "psring advise against the hosts bed"). With R > 1 the ps reduces
  within each host before pushing, as BytePS does (from PSRING_PS_HOST_REDUCE bytes, in blocks of
  PSRING_PS_HOST_BLOCK): local rank l pushes the host's partial of slice l, so a host's link carries
  what one worker's would, and the ranks pay the hierarchical ring's memory traffic; below that size
  every rank pushes its own tensor (2R(H-1)/H S for colocated shards, max(R S, N S / k) dedicated).
- Stragglers: a ring step waits for its slowest rank; a ps step with ``backup=b`` waits for the
  N-b fastest pushes (``SyncSGD(..., backup=b)``); the model adds the expected wait given the
  straggler delay you name (``--straggler-ms``), a rank late by a uniform 0-2x of it.

``probe`` is the job ``--store`` mode submits to the cluster's idle worker daemons: it times the
ring's all-reduce at a small and a large size there, and the model's latency and bandwidth are
fitted to those two times (the cluster's own links, as the ring uses them).
"""

from __future__ import annotations

import math
import re
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .. import settings
from ..core.codec import CODECS
from ..settings import parse_bytes
from ..topology.ps.plan import WIRE_PIECES, link_tuning, piece_bytes
from ..topology.ring.paths import SMALL_BYTES, RingPaths

_RATE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?)(bit|bps|b|B)?(?:/s)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``25M`` -> 26214400 bytes (K, M, G: powers of 1024; the settings' byte counts)."""
    try:
        value = parse_bytes(text)
    except ValueError:
        raise ValueError(f"size {text!r} does not parse (examples: 4, 1M, 25M, 1G)") from None
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


def parse_sizes(text: str) -> list[int]:
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise ValueError(f"--sizes {text!r} names no size")
    return sizes


def parse_rate(text: str) -> float:
    """A link rate as tc writes it (``1gbit``, ``100mbit``) or in bytes (``125MB``): bytes per second."""
    m = _RATE.match(text)
    if not m:
        raise ValueError(f"rate {text!r} does not parse (examples: 1gbit, 10gbit, 100mbit, 125MB)")
    scale = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m[2].lower()]
    unit = (m[3] or "bit").lower()
    value = float(m[1]) * scale / (8.0 if unit in ("bit", "bps") and m[3] != "B" else 1.0)
    if value <= 0:
        raise ValueError(f"rate {text!r} must be positive")
    return value


def parse_seconds(text: str) -> float:
    """``50us``, ``0.2ms``, ``1s`` -> seconds."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(us|ms|s)?\s*", text)
    if not m:
        raise ValueError(f"latency {text!r} does not parse (examples: 50us, 0.2ms)")
    return float(m[1]) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[m[2]]


@dataclass(frozen=True)
class Links:
    """What the model knows of the network: between hosts, and within one."""

    latency: float  # seconds per message between hosts (the wire and the kernels)
    bandwidth: float  # bytes/s each way of a host's link
    local_latency: float = 20e-6
    local_bandwidth: float = 4e9
    #: a process's CPU time per message it sends or takes in (psring's Python path: ~20 us); a ring
    #: rank pays it at each of its sequential steps, a shard for each of the N pushes and N pulls of a piece
    per_message: float = 20e-6


@dataclass(frozen=True)
class Layout:
    hosts: int
    ranks_per_host: int = 1
    server_hosts: int = 0  # CPU hosts free for servers (no worker on them)
    straggler: float = 0.0  # seconds: a rank is late by a uniform 0-2x of this, each step
    backup: int = 1  # the backup workers the ps would run with where stragglers are named

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.ranks_per_host < 1:
            raise ValueError(f"hosts ({self.hosts}) and ranks per host ({self.ranks_per_host}) must be >= 1")
        if self.hosts * self.ranks_per_host < 2:
            raise ValueError("one worker needs no all-reduce: give at least 2 workers")
        if self.server_hosts < 0:
            raise ValueError(f"server hosts must be >= 0, got {self.server_hosts}")
        if not 0 <= self.backup < self.workers:
            raise ValueError(f"backup must be in [0, {self.workers}) for {self.workers} workers, got {self.backup}")

    @property
    def workers(self) -> int:
        return self.hosts * self.ranks_per_host


def _pushers(layout: Layout) -> tuple[int, int]:
    """(the workers whose copies of a large tensor's piece a shard takes, of them per host): a host
    reduces within itself before pushing where it holds several ranks (PSRING_PS_HOST_REDUCE)."""
    if layout.ranks_per_host > 1 and settings.current().ps_host_reduce > 0:
        return layout.hosts, 1
    return layout.workers, layout.ranks_per_host


def split_time(layout: Layout, x: float) -> float:
    """The BytePS split's bytes time, in units of S / bandwidth, with share x of every tensor on the
    dedicated shards: the flows on a worker host's link share it equally while they last (TCP's
    fairness, max-min), a flow to a dedicated shard at most its server host's link over the pushers
    that reach it. Its k dedicated flows, its pushes to the colocated shards of other hosts and its
    own shards' answers to them run side by side: the colocated ones take their share of the link
    while the dedicated shards' links idle, so the share that evens the links' bytes (BytePS's, the
    equal-load bound) runs long. The bed's runs against this model: docs/performance-history.md ("psring advise
    against the hosts bed")."""
    n, r, k = layout.workers, layout.ranks_per_host, layout.server_hosts
    pushers, per_host = _pushers(layout)
    # [flows on the link, bytes left in each (units of S), the most one flow may take of the link]
    groups = [
        [per_host * k, x / k, 1.0 / pushers],  # to the dedicated shards
        [per_host * (n - r), (1.0 - x) / n, math.inf],  # to the colocated shards on other hosts
        [r * (pushers - per_host), (1.0 - x) / n, math.inf],  # this host's shards' answers to them
    ]
    live = [g for g in groups if g[0] > 0 and g[1] > 1e-12]
    t = 0.0
    while live:
        rates: dict[int, float] = {}
        room, flows = 1.0, sum(g[0] for g in live)
        for i, g in sorted(enumerate(live), key=lambda ig: ig[1][2]):  # water-filling: capped flows first
            rate = min(g[2], room / flows)
            rates[i] = rate
            room -= rate * g[0]
            flows -= g[0]
        step = min(g[1] / rates[i] for i, g in enumerate(live))
        for i, g in enumerate(live):
            g[1] -= rates[i] * step
        t += step
        live = [g for g in live if g[1] > 1e-12]
    return t


def split_share(layout: Layout) -> float:
    """The share of each tensor for the dedicated hosts that makes the split fastest (:func:`split_time`,
    in hundredths; 1: all of it, ps dedicated). Where the dedicated shards' links are not the limit
    that is every shard's equal slice, k / (N + k) -- equal flows finish together, none idles a link --
    and then it is exactly that (no weights needed)."""
    n, k = layout.workers, layout.server_hosts
    if k == 0:
        return 0.0
    best = min(range(1, 101), key=lambda c: (round(split_time(layout, c / 100), 9), -c)) / 100
    equal = k / (n + k)
    return equal if split_time(layout, equal) <= split_time(layout, best) * (1 + 1e-3) else best


#: the split's weights are whole numbers: a share is counted in this many parts of a tensor
WEIGHT_PARTS = 10_000


def split_weights(layout: Layout) -> tuple[int, ...]:
    """PSRING_PS_WEIGHTS for the BytePS split: a shard colocated with each of the N workers (shard
    ids 0..N-1, PSRING_PS_COLOCATE), then the k dedicated ones (PSRING_PS_DEDICATED=k), sharing
    :func:`split_share` of every tensor between them."""
    n, k = layout.workers, layout.server_hosts
    if k == 0:
        return (1,) * n
    x = split_share(layout)
    if x == k / (n + k):
        return (1,) * (n + k)
    colocated = max(1, round((1.0 - x) / n * WEIGHT_PARTS))
    dedicated = max(1, round(x / k * WEIGHT_PARTS))
    common = math.gcd(colocated, dedicated)
    return (colocated // common,) * n + (dedicated // common,) * k


def ps_tuning(layout: Layout, links: Links) -> dict[str, str]:
    """The ps's settings for these links where they differ from what psring would run with (between
    hosts only): :func:`~psring.topology.ps.plan.link_tuning`'s rule, which a job also applies by
    itself to the links its set-up probe measures where these settings are unset -- printed so that a
    job whose rank 0 measures nothing (it reaches no shard on another host) runs with them too."""
    if layout.hosts == 1 and layout.server_hosts == 0:
        return {}
    config = settings.current()
    pieces, sndbuf = link_tuning(links.bandwidth, 2 * links.latency)  # the wire's round trip (the kernel acks)
    out = {}
    if pieces > WIRE_PIECES and (config.ps_wire_pieces or WIRE_PIECES) < pieces:
        out["PSRING_PS_WIRE_PIECES"] = str(pieces)
    if sndbuf and config.ps_sndbuf is None:
        out["PSRING_PS_SNDBUF"] = f"{sndbuf >> 10}K"
    return out


def settings_for(name: str, layout: Layout, links: Links | None = None) -> dict[str, str]:
    """The PSRING_* settings that run topology ``name`` (as :func:`predict` names them); with the
    links, the ps's tuning for them too (:func:`ps_tuning`)."""
    if links is not None and name.startswith(("ps", "BytePS")):
        return {**settings_for(name, layout), **ps_tuning(layout, links)}
    k = layout.server_hosts
    if name == "ring":
        return {"PSRING_TOPOLOGY": "ring", "PSRING_HIERARCHICAL": "off"}
    if name == "hierarchical":
        return {"PSRING_TOPOLOGY": "ring", "PSRING_HIERARCHICAL": "on"}
    if name == "ps colocated":
        return {"PSRING_TOPOLOGY": "ps", "PSRING_PS_COLOCATE": "1"}
    if name == "ps dedicated":  # the shards: psring server --shard i --num-shards k on each server host
        return {"PSRING_TOPOLOGY": "ps"}
    if name == "BytePS split":  # and psring server --shard N+i --num-shards N+k on each server host
        weights = split_weights(layout)
        return {
            "PSRING_TOPOLOGY": "ps",
            "PSRING_PS_COLOCATE": "1",
            "PSRING_PS_DEDICATED": str(k),
            # equal slices (the usual best: split_share) need no weights
            **({"PSRING_PS_WEIGHTS": ",".join(map(str, weights))} if len(set(weights)) > 1 else {}),
        }
    if name.startswith("ps backup"):
        return {"PSRING_TOPOLOGY": "ps"}
    raise ValueError(f"no settings for topology {name!r}")


def _piece(size: float, shards: int) -> float:
    """The bytes of the last piece of a shard's slice, as psring cuts a collective across hosts."""
    config = settings.current()
    pieces = config.ps_wire_pieces or WIRE_PIECES
    piece = piece_bytes(int(size), shards, config.ps_piece, config.ps_wire_piece, True, pieces)
    return min(size / max(shards, 1), piece)


def predict(size: int, layout: Layout, links: Links) -> dict[str, float]:
    """Seconds one all-reduce of ``size`` bytes takes on each topology the layout allows (no
    stragglers: :func:`step_times` adds them)."""
    n, h, r, k = layout.workers, layout.hosts, layout.ranks_per_host, layout.server_hosts
    a, b = links.latency, links.bandwidth
    a_loc, b_loc = links.local_latency, links.local_bandwidth
    s = float(size)
    c = links.per_message
    fan = 2 * n * c  # a shard takes N pushes of a piece and sends N pulls
    out: dict[str, float] = {}
    if h == 1:  # one host: every link is memory
        out["ring"] = 2 * (n - 1) * (a_loc + c) + 2 * (n - 1) / n * s / b_loc
        out["ps colocated"] = 2 * a_loc + fan + 2 * (n - 1) / n * s / b_loc
        return out
    out["ring"] = 2 * (n - 1) * (a + c) + 2 * (n - 1) / n * s / b
    config = settings.current()
    if RingPaths(two_hop_min=max(config.ring_two_hop_min, 1), two_hop_max=config.ring_two_hop).two_hop(size, n):
        out["ring"] = 2 * (a + c) + 2 * r * (h - 1) / h * s / b  # two hops over the TCP small-message links
    if r > 1 and size <= SMALL_BYTES:  # a small call of a two-level job takes the one-hop path, as a flat one
        out["hierarchical"] = 2 * (n - 1) * (a + c) + 2 * (n - 1) / n * s / b
    elif r > 1:
        out["hierarchical"] = 2 * (h - 1) * (a + c) + 2 * (h - 1) / h * s / b
        out["hierarchical"] += 2 * (r - 1) * (a_loc + c) + 2 * (r - 1) / r * s / b_loc
    # the ps reduces within the host before pushing (PSRING_PS_HOST_REDUCE): a host then pushes as one
    # worker would, local rank l the host's partial of slice l (of R), its result handed round in memory
    local = 0.0
    pushers, per_host = n, r  # the workers whose copies of a piece a shard takes, and of them per host
    from_bytes = settings.current().ps_host_reduce  # 0: off
    if r > 1 and 0 < from_bytes <= s:
        local = 2 * (r - 1) * (a_loc + c) + 2 * (r - 1) / r * s / b_loc
        pushers, per_host = h, 1
        s_piece = min(s, settings.current().ps_host_block) / r  # a block's slice, cut over the shards
    else:
        s_piece = s
    # a shard per worker; its first piece comes from the workers on the other hosts before any
    # result goes, its last piece goes to them after the bytes
    remote = pushers - per_host
    out["ps colocated"] = (
        2 * a + fan + local + 2 * per_host * (h - 1) / h * s / b + 2 * remote * _piece(s_piece, n) / b
    )
    if k > 0:
        out["ps dedicated"] = (
            2 * a + fan + local + max(per_host * s, pushers * s / k) / b + 2 * pushers * _piece(s_piece, k) / b
        )
        x = split_share(layout)
        if 0.0 < x < 1.0:  # (x = 1 is ps dedicated)
            # psring cuts the pieces for all N + k shards; a dedicated one's last goes to every pusher
            fill = drain = pushers * min(_piece(s_piece, n + k), s_piece * x / k) / b
            out["BytePS split"] = 2 * a + fan + local + split_time(layout, x) * s / b + fill + drain
    return out


def step_times(sizes: list[int], layout: Layout, links: Links) -> dict[str, float]:
    """A step's communication: the tensors' all-reduces one after another (stragglers once)."""
    total: dict[str, float] = {}
    for size in sizes:
        for name, t in predict(size, layout, links).items():
            total[name] = total.get(name, 0.0) + t
    if layout.straggler > 0:  # one rank late by a uniform 0-2x: every step waits for it, the delay on average
        best_ps = min(t for name, t in total.items() if name.startswith("ps"))  # psring's own placements
        total = {name: t + layout.straggler for name, t in total.items()}
        if layout.backup >= 1:  # the ps takes the first N - b pushes of a piece: the late one is dropped
            total[f"ps backup={layout.backup}"] = best_ps
    return total


def _reason(best: str, times: dict[str, float], layout: Layout, sizes: list[int]) -> str:
    n, h, r, k = layout.workers, layout.hosts, layout.ranks_per_host, layout.server_hosts
    ring = times["ring"]
    edge = f"{ring / times[best]:.2f}x the flat ring" if best != "ring" else "the fastest"
    if best == "ring":
        if max(sizes) < 64 << 10:
            return "small tensors: every topology is latency-bound, and the ring needs no server"
        return (
            f"no host is free for servers, so a ps link carries as much as a ring's ({2 * (n - 1) / n:.2f} S "
            "each way) and the ring needs no server process"
            if k == 0
            else "the ring's steps cost less than the server hosts can save here"
        )
    if best == "hierarchical":
        return (
            f"{r} ranks per host: reducing within each host first leaves {2 * (h - 1) / h:.2f} S per direction "
            f"on a host's link where the flat ring puts more; {edge}"
        )
    if best == "ps dedicated":
        return (
            f"{k} server host(s) take the reduction off the workers' links: a worker pushes S and pulls S where "
            f"the ring moves {2 * (n - 1) / n:.2f} S each way (BytePS); {edge}"
        )
    if best == "BytePS split":
        x = split_share(layout)
        return (
            f"{k} server host(s) for {n} workers: {x:.0%} of every tensor on the dedicated shards and the rest on "
            f"shards beside the workers keeps the server hosts' links busy beside the workers' (BytePS's split, "
            f"the share for links their flows share fairly); {edge}"
        )
    if best.startswith("ps backup"):
        return (
            f"a straggler late by up to {2 * layout.straggler * 1e3:.0f} ms holds every ring step; a ps step "
            f"with backup={layout.backup} completes without it (SyncSGD(..., backup={layout.backup})); {edge}"
        )
    return f"fewer latency steps (2 against the ring's {2 * (n - 1)}); {edge}"


#: simpler first: a topology is recommended over a simpler one only when it is this much faster
PREFERENCE = ("ring", "hierarchical", "ps colocated", "ps dedicated", "BytePS split")
MARGIN = 0.05
#: predicted, printed, never recommended: psring cannot run it yet (none now)
MODEL_ONLY: dict[str, str] = {}




def codec_times(sizes: list[int], layout: Layout, links: Links) -> dict[str, float]:
    """A step's communication with each codec: the coded ring's (a codec never takes the two levels,
    the plane or two hops) -- its narrower bytes on the wire, the scale's agreement, and the CPU
    (``Codec.cpu_ns``: a rank takes its amax and encodes once, and for (N-1)/N of the elements decodes
    twice, adds and encodes in the reduce-scatter, then decodes in the all-gather)."""
    n, h = layout.workers, layout.hosts
    a, b = (links.latency, links.bandwidth) if h > 1 else (links.local_latency, links.local_bandwidth)
    c = links.per_message
    out: dict[str, float] = {}
    for name, codec in CODECS.items():
        enc, dec, amax = codec.cpu_ns
        total = 0.0
        for size in sizes:
            elems = size / 4
            total += 2 * (n - 1) * (a + c) + 2 * (n - 1) / n * elems * codec.wire.itemsize / b
            if codec.scaled:  # a max all_reduce of the scales' inputs first
                agreed = 4.0 * codec.amax_size(int(elems))
                total += 2 * (n - 1) * (a + c) + 2 * (n - 1) / n * agreed / b
            total += elems * (amax + enc + (n - 1) / n * (3 * dec + enc + 0.3)) * 1e-9
        out[name] = total + layout.straggler  # a straggler holds every ring step alike
    return out


def _codec_advice(sizes: list[int], layout: Layout, links: Links, plain: float) -> dict[str, Any]:
    """Whether a codec pays here: its predicted step against the best plain topology's ``plain``."""
    times = codec_times(sizes, layout, links)
    name = min(times, key=lambda k: times[k])
    if times[name] < plain * (1 - MARGIN):
        reason = (
            f"{name} moves {CODECS[name].wire.itemsize / 4:.0%} of the bytes: the link is the limit here "
            f"({times[name] * 1e3:.2f} ms against {plain * 1e3:.2f} ms a step, its CPU counted)"
        )
        return {"recommended": name, "predicted_s": times, "reason": reason}
    reason = (
        f"none: on this link a codec's CPU costs more than its bytes save (the best, {name}, "
        f"{times[name] * 1e3:.2f} ms against {plain * 1e3:.2f} ms a step)"
    )
    return {"recommended": None, "predicted_s": times, "reason": reason}


#: the local steps ``advise`` chooses among (DiLoCo's paper ran 50 to 1000; past 500 the loss paid grows)
LOCAL_STEPS = (1, 2, 5, 10, 20, 50, 100, 200, 500)
#: the compute use an unstreamed outer step must leave (the 10% that an exchange may take)
COMPUTE_USE = 0.9
#: the fragments ``advise`` streams with (``SyncSGD(fragments=4)``: each one's exchange hides in H/4 steps)
FRAGMENTS = 4


def local_steps_advice(sizes: list[int], layout: Layout, links: Links, step_s: float, plain: float) -> dict[str, Any]:
    """How often to talk (``SyncSGD(local_steps=H, fragments=K)``), given ``step_s``, one step's compute.

    An outer step exchanges the model once: ``T``, the cheapest of the plain step (``plain``) and each
    codec's (:func:`codec_times`, CPU counted). Synchronous SGD pays ``T`` every step; local SGD once every
    H steps, so compute use is ``H step_s / (H step_s + T)``: the smallest H of :data:`LOCAL_STEPS` that
    keeps it at :data:`COMPUTE_USE` or more. Streamed in K fragments, a fragment's exchange (``T / K``)
    runs beside the next H/K steps, so H needs only ``H step_s >= T``: when that gives a smaller H
    (K <= H), fragments are advised. H = 1 where the exchange already costs 10% of a step or less: the
    fewer outer steps, the more the loss pays (psring's own table: docs/performance.md, "Local SGD")."""
    times = {"none": plain, **codec_times(sizes, layout, links)}
    codec = min(times, key=lambda k: times[k])
    t = times[codec]
    if plain <= (1 / COMPUTE_USE - 1) * step_s:
        return {"local_steps": 1, "fragments": 1, "compression": None, "exchange_s": plain,
                "compute_use": step_s / (step_s + plain),
                "reason": f"H = 1 (synchronous SGD): a step's exchange, {plain * 1e3:.2f} ms, is at most "
                          f"{1 / COMPUTE_USE - 1:.0%} of its {step_s * 1e3:.2f} ms of compute"}  # fmt: skip
    need = (COMPUTE_USE / (1 - COMPUTE_USE)) * t / step_s  # H step_s / (H step_s + t) >= COMPUTE_USE
    unstreamed = next((x for x in LOCAL_STEPS if x >= need), None)
    streamed = next((x for x in LOCAL_STEPS if x >= max(t / step_s, FRAGMENTS)), None)
    if unstreamed is not None and (streamed is None or unstreamed <= streamed):
        h, k, use = unstreamed, 1, unstreamed * step_s / (unstreamed * step_s + t)
    else:  # streamed: a fragment's exchange (t / K) beside H / K steps, waited for only where it is longer
        h, k = streamed or LOCAL_STEPS[-1], FRAGMENTS
        use = min(1.0, h * step_s / t)
    shrink = 1.0 if codec == "none" else 4 / CODECS[codec].wire.itemsize
    how = f"in {k} fragments, each exchange beside the next {h / k:g} steps" if k > 1 else "unstreamed"
    reason = (
        f"H = {h} ({how}), compression={codec if codec != 'none' else None!r}: an outer exchange is predicted "
        f"{t * 1e3:.1f} ms against {step_s * 1e3:.2f} ms of compute a step, so about {use:.0%} compute use "
        f"and {h * shrink:.0f}x fewer bytes than synchronous SGD"
    )
    if h == LOCAL_STEPS[-1] and use < COMPUTE_USE:
        reason += f" (the most advised: the link stays the limit, at {use:.0%})"
    return {"local_steps": h, "fragments": k, "compression": None if codec == "none" else codec, "exchange_s": t,
            "compute_use": use, "reason": reason}  # fmt: skip


def advise(sizes: list[int], layout: Layout, links: Links, step_s: float | None = None) -> dict[str, Any]:
    times = step_times(sizes, layout, links)
    runnable = {name: t for name, t in times.items() if name not in MODEL_ONLY}
    fastest = min(runnable.values())
    rank = {name: PREFERENCE.index(name) if name in PREFERENCE else len(PREFERENCE) for name in runnable}
    near = [name for name in runnable if runnable[name] <= fastest * (1 + MARGIN)]
    best = min(near, key=lambda name: (rank[name], runnable[name]))
    return {
        "layout": {**asdict(layout), "workers": layout.workers},
        "links": asdict(links),
        "sizes": sizes,
        "predicted_s": times,
        "recommended": best,
        "reason": _reason(best, times, layout, sizes),
        "settings": settings_for(best, layout, links),
        "model_only": {name: why for name, why in MODEL_ONLY.items() if name in times},
        # compression= (psring.core.codec): whether a codec pays on these links, against the plain best
        "compression": _codec_advice(sizes, layout, links, runnable[best]),
        # local SGD (SyncSGD(local_steps=H)): how often to talk, where the compute of a step is known
        "local_steps": None if step_s is None else local_steps_advice(sizes, layout, links, step_s, runnable[best]),
    }


def fit_links(workers: int, small: tuple[int, float], large: tuple[int, float], local: Links | None = None) -> Links:
    """Latency and bandwidth from the ring's time at two sizes: T(S) = 2(N-1) a + 2(N-1)/N S / b."""
    (s1, t1), (s2, t2) = small, large
    if s2 <= s1:
        raise ValueError("the large probe must be larger than the small one")
    steps, share = 2 * (workers - 1), 2 * (workers - 1) / workers
    slope = (t2 - t1) / (s2 - s1)
    bandwidth = share / slope if slope > 0 else math.inf
    latency = max((t1 - share * s1 / bandwidth) / steps, 1e-7)
    # what was fitted is a ring step's whole cost, the wire's latency and the processes' time per
    # message together; two sizes cannot tell them apart. Counted as 90% CPU: on the hosts bed a step
    # of ~150 us is nearly all processes' time (a LAN's wire latency is tens of us), and that split
    # predicts the ps's and the hierarchical ring's small messages there best (benchmarks/advise_check.py)
    per_message = 0.9 * latency
    base = local or Links(latency - per_message, bandwidth)
    return Links(latency - per_message, bandwidth, base.local_latency, base.local_bandwidth, per_message)


def model_sizes(name: str) -> list[int]:
    """The tensors' sizes (bytes) of a ``psring train`` model, or of a torch module (``pkg.mod:attr``:
    a module, or a callable that returns one)."""
    if name in ("mlp", "embed"):
        from ..training import embed, model

        params = model.init_params(0) if name == "mlp" else embed.init_params(0)
        return [int(v.nbytes) for v in params.values()]
    module_name, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"--model {name!r}: give mlp, embed, or a torch module as pkg.module:attr")
    import importlib

    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--model {name!r} cannot be loaded: {exc}") from exc
    module = obj() if callable(obj) and not hasattr(obj, "parameters") else obj
    if not hasattr(module, "parameters"):
        raise ValueError(f"--model {name!r} is not a torch module (it has no parameters())")
    return [int(p.numel() * p.element_size()) for p in module.parameters() if p.requires_grad]


async def probe(group: Any, small: int = 4 << 10, large: int = 8 << 20, iters: int = 5) -> dict[str, Any]:
    """The cluster job of ``psring advise --store``: the ring's all-reduce timed at two sizes (median
    of ``iters``, after a warm-up), and each rank's host, so the layout is known too."""
    hosts = await group.all_gather(np.frombuffer(socket.gethostname().encode()[:64].ljust(64), dtype=np.uint8))
    names = [bytes(np.asarray(h)).rstrip(b" ").decode(errors="replace") for h in hosts]
    out: dict[str, Any] = {"world": group.world_size, "hosts": names}
    for label, size in (("small", small), ("large", large)):
        buf = np.ones(size // 4, dtype=np.float32)
        await group.all_reduce(buf)  # warm-up: connections, buffers
        times = []
        for _ in range(iters):
            await group.barrier()
            t0 = time.perf_counter()
            await group.all_reduce(buf)
            times.append(time.perf_counter() - t0)
        slowest = await group.all_reduce(np.array([statistics.median(times)], dtype=np.float64), op="max")
        out[label] = [size, float(np.asarray(slowest)[0])]
    return out
