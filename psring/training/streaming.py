"""Streaming DiLoCo for SyncSGD: the model in K fragments, one fragment's exchange at a time, each
overlapping the next inner steps.

``SyncSGD(..., local_steps=H, outer=..., fragments=K)`` splits the dense parameters into K fragments of
whole parameters, in their order and about equal in bytes (each fragment its own buckets). Fragment i
is synchronised after the inner steps t with ``t % H == i*H//K`` (t counted from 1): its
pseudo-gradient ``global - local`` is taken then, and its exchange (the average over the ranks, with
the codec if any, and the outer optimizer's step on that fragment: on every ring rank, or on the ps
shards) runs as an asyncio task while the rank takes its next inner steps.

Its result is applied at a fixed point, ``delay = H//K`` inner steps later (one fragment period: the
next fragment's launch), never "whenever it lands": so the bits do not depend on timing, and the ring,
the parameter server and a one-process model agree. Applying it, the rank's local copy of the fragment
becomes the new global parameters plus the inner progress made while the exchange was in flight
(``local = new_global + (local - local_at_launch)``): nothing is lost, nothing counted twice. A step
waits for an exchange only when it has not landed by then (the link is slower than a fragment
period's compute); at most one is in flight.

Knows a schedule and a task, not the topology: the placement runs the exchange.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any


def split_params(sizes: Sequence[int], k: int) -> list[int]:
    """Where K contiguous fragments of parameters (by their sizes in bytes, in order) start, each at
    least one parameter, the cuts as close as they can be to every K-th of the bytes."""
    n = len(sizes)
    if k > n:
        raise ValueError(
            f"fragments={k}: the model has {n} dense parameter(s); a fragment is made of whole parameters, "
            f"so there can be at most {n}"
        )
    cum = [0]
    for s in sizes:
        cum.append(cum[-1] + int(s))
    total = cum[-1]
    starts = [0]
    for i in range(1, k):
        lo, hi = starts[-1] + 1, n - (k - i)  # leave one parameter for each fragment after this one
        want = total * i / k
        starts.append(min(range(lo, hi + 1), key=lambda j: (abs(cum[j] - want), j)))
    return starts


@dataclass
class Flight:
    """A fragment's exchange in flight: the task, the inner step whose end applies it, and the local
    copies of its buckets as they were at launch."""

    fragment: int
    due: int
    task: asyncio.Future[Any]
    snaps: list[Any]


class Streaming:
    """The schedule of K fragments over H inner steps, and the one exchange in flight."""

    def __init__(self, fragments: int, every: int, buckets_of: list[list[int]]) -> None:
        if type(fragments) is not int or fragments < 1:
            raise ValueError(f"fragments={fragments!r} must be a positive integer")
        if fragments > every:
            raise ValueError(
                f"fragments={fragments} needs at least as many local_steps (got {every}): each fragment is "
                "synchronised at its own inner step of the H"
            )
        assert len(buckets_of) == fragments
        self.count = fragments
        self.every = every
        #: each fragment's buckets (SyncSGD's indices)
        self.buckets_of = buckets_of
        #: the inner step (mod H) after which each fragment's exchange starts
        self.offset = [(i * every) // fragments for i in range(fragments)]
        #: inner steps from an exchange's start to the end of the step that applies it
        self.delay = every // fragments
        #: outer steps each fragment has taken (over ps: the step its buckets are at on the shards)
        self.rounds = [0] * fragments
        self.flight: Flight | None = None

    def starting(self, t: int) -> int | None:
        """The fragment whose exchange starts after inner step t (counted from 1), if any."""
        if t <= 0:
            return None
        phase = t % self.every
        return self.offset.index(phase) if phase in self.offset else None

    def launch(self, fragment: int, t: int, snaps: list[Any], exchange: Awaitable[Any]) -> None:
        assert self.flight is None, "one exchange at a time"
        self.flight = Flight(fragment, t + self.delay, asyncio.ensure_future(exchange), snaps)

    async def land(self, apply: Callable[[Flight], Awaitable[None]]) -> None:
        """Wait for the exchange in flight (its error raised here), then ``apply`` it."""
        flight, self.flight = self.flight, None
        if flight is None:
            return
        await flight.task
        self.rounds[flight.fragment] += 1
        await apply(flight)

    async def settle(self) -> None:
        """Wait for the exchange in flight to land (not applied to the local copies: that stays at its
        step); its error raised here."""
        if self.flight is not None:
            await asyncio.shield(self.flight.task)

    def config(self) -> dict[str, Any]:
        return {"fragments": self.count, "buckets": self.buckets_of}


__all__ = ["Flight", "Streaming", "split_params"]
