"""The links between a ps job's workers and its shards on other hosts, measured once at set-up, and
the pieces and send buffers the job takes for them (:func:`~psring.topology.ps.plan.link_tuning`,
the rule ``psring advise`` prints too).

Rank 0 measures and writes the job's choice to the store before the ranks' ready barrier; every
worker (a joiner too) reads it after, so the pieces every shard's join checks agree. A setting
given (``PSRING_PS_WIRE_PIECES``, ``PSRING_PS_SNDBUF``) is kept as it is: rank 0's is the job's.

The measure: the round trip is the least the kernel saw on each connection (TCP_INFO, the
wire's time without either process's); the rate is rank 0's link out, timed as it sends a
megabyte or more spread over its shards on other hosts and each answers when its share is in
(the larger of two rounds, the second sized to last ~20 ms).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ....errors import PsringError
from ....transport.connection import Connection
from ....transport.samehost import elsewhere
from ....transport.tcpsocket import kernel_round_trip
from .. import frames
from ..plan import WIRE_PIECES, link_tuning

logger = logging.getLogger(__name__)

#: the first round's bytes; the second's last about ROUND_S at the first's rate, within [FIRST, MOST]
FIRST = 1 << 20
MOST = 8 << 20
ROUND_S = 0.02
#: the most a probe waits for its answers (it then measures nothing: the defaults stand)
WAIT_S = 10.0

_tags = itertools.count()


@dataclass(frozen=True)
class Tuning:
    """The job's pieces a slice and send buffer, and the links they were chosen for (None: not measured)."""

    pieces: int = WIRE_PIECES
    sndbuf: int = 0
    rate: float | None = None  # bytes/s
    round_trip: float | None = None  # seconds

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes | None) -> Tuning:
        if not raw:
            return cls()
        try:
            fields = json.loads(raw)
            tuning = cls(**fields)
        except (ValueError, TypeError) as exc:
            raise PsringError(f"the job's link tuning in the store does not parse ({raw[:200]!r}): {exc}") from None
        if type(tuning.pieces) is not int or tuning.pieces < 1 or type(tuning.sndbuf) is not int or tuning.sndbuf < 0:
            raise PsringError(f"the job's link tuning in the store is out of range: {tuning}")
        return tuning

    def __str__(self) -> str:
        links = (
            "not measured"
            if self.rate is None or self.round_trip is None
            else f"{self.rate * 8 / 1e9:.3g} Gbit/s, round trip {self.round_trip * 1e6:.0f} us"
        )
        buffer = f"{self.sndbuf >> 10} KiB send buffers" if self.sndbuf else "the kernel's send buffers"
        return f"links to other hosts {links}: {self.pieces} pieces a slice, {buffer}"


#: a link probe's answers awaited, by tag (the links' table: their reader completes them)
Probes = dict[tuple[Any, ...], asyncio.Future[None]]


def remote(shards: Sequence[Connection]) -> list[Connection]:
    """The open socket connections among a worker's links to its shards that reach other hosts."""
    return [c for c in shards if c.is_open and not c.is_local and elsewhere(c.peer.get("host"))]


async def _round(probes: Probes, conns: list[Connection], nbytes: int, timeout: float) -> float:
    """Seconds until every shard in conns has answered its share of nbytes."""
    share = memoryview(bytes(max(nbytes // len(conns), 1)))
    loop = asyncio.get_running_loop()
    tags = [("link", next(_tags)) for _ in conns]
    waits = [probes.setdefault(tag, loop.create_future()) for tag in tags]
    start = time.perf_counter()
    try:
        for conn, tag in zip(conns, tags, strict=True):
            conn.send_frame(frames.link(tag), share)
        async with asyncio.timeout(timeout):
            await asyncio.gather(*waits)
    finally:
        for tag, fut in zip(tags, waits, strict=True):
            probes.pop(tag, None)
            fut.cancel()
    return time.perf_counter() - start


async def measure(
    shards: Sequence[Connection], probes: Probes, timeout: float, rank: int
) -> tuple[float, float] | None:
    """(rate in bytes/s, round trip in seconds) of a worker's links to shards on other hosts (among
    ``shards``), or None where it reaches none, or the shards do not answer within WAIT_S (or
    ``timeout``). ``probes``: where the links' reader completes the answers."""
    conns = remote(shards)
    if not conns:
        return None
    timeout = min(WAIT_S, timeout)
    try:
        first = FIRST / await _round(probes, conns, FIRST, timeout)
        size = int(min(MOST, max(FIRST, first * ROUND_S)))
        rate = max(first, size / await _round(probes, conns, size, timeout))
    except (TimeoutError, PsringError) as exc:
        logger.warning("rank %d: the links to the shards on other hosts were not measured (%s)", rank, exc)
        return None
    trips = [t for t in (kernel_round_trip(c) for c in conns) if t is not None]
    # without the kernel's word the first round's time stands in: far above any round trip small
    # buffers would cover, so the kernel keeps sizing them
    return rate, max(trips) if trips else FIRST / first


def choose(config: Any, measured: tuple[float, float] | None) -> Tuning:
    """Rank 0's choice for the job: its settings where given, the rule for the links it measured where not."""
    pieces, sndbuf = link_tuning(*measured) if measured is not None else (WIRE_PIECES, 0)
    return Tuning(
        pieces=config.ps_wire_pieces or pieces,
        sndbuf=sndbuf if config.ps_sndbuf is None else config.ps_sndbuf,
        rate=measured[0] if measured is not None else None,
        round_trip=measured[1] if measured is not None else None,
    )


def needs_measure(config: Any) -> bool:
    """Whether a setting is left to the job (auto)."""
    return config.ps_wire_pieces is None or config.ps_sndbuf is None


def key(prefix: str) -> str:
    return f"{prefix}/links"
