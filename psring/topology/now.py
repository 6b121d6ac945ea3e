"""What a short way answers: a call ended on the caller's thread, or carried on by the event loop, or not now.

A group may run a call on the caller's thread when nothing of it is in flight on the loop (the ring's
boards, its TCP one- and two-hop calls, its data plane in C: ring.chooser's ``Algorithm.soon``).
:meth:`~psring.topology.group.Group.try_now` answers with one of these, and the blocking facade
(topology.blocking) and the torch backend take it by that interface.
"""

from __future__ import annotations

from typing import Any


class Done(tuple):
    """The call ended here: its result (``Done((value,))``: made in C, as a tuple is -- the boards' 4-byte
    calls take a few microseconds in all)."""

    __slots__ = ()

    @property
    def value(self) -> Any:
        return self[0]


class Carry(tuple):
    """A peer was late: the call was begun here and ``rest`` (a coroutine) finishes it on the event loop
    (``Carry((rest,))``)."""

    __slots__ = ()

    @property
    def rest(self) -> Any:
        return self[0]


#: the answer of a short way that did nothing: take the event loop's way
NOT_NOW = None

#: a short way's answer (None: not now)
Now = Done | Carry | None

__all__ = ["NOT_NOW", "Carry", "Done", "Now"]
