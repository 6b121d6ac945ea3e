"""The ring's frames over its ranks' connections: every header a rank sends, made here.

- ``data``: a piece of collective seq, ``tag`` = (gid, seq, phase, ...) naming where it goes, with the
  call's descriptor (a rank that made another call is named in a MismatchError) and the sender's rank;
  or a point-to-point array (gid, "p2p", src, n);
- ``abort``: collective (gid, seq) abandoned on every rank (mismatch, timeout), or every call of the
  job's groups ("*", -1) because a rank was lost.

The small-message links (ring.smalllinks) carry (gid, seq, phase, call) messages of their own
(psring.core.wire.encode_message); the boards post tags of their own (ring.board).
"""

from __future__ import annotations

from typing import Any


def data(gid: str, seq: int, tag: tuple[Any, ...], call: tuple[Any, ...], src: int) -> dict[str, Any]:
    """A piece of collective seq: ``tag`` the rest of its address (a phase, a chunk, a piece)."""
    return {"kind": "data", "tag": (gid, seq, *tag), "call": call, "src": src}


def p2p(gid: str, src: int, n: int, device: str) -> dict[str, Any]:
    """The n-th array rank src sends to one peer in group gid."""
    return {"kind": "data", "tag": (gid, "p2p", src, n), "dev": device}


def abort(gid: str, seq: int, reason: str, message: str) -> dict[str, Any]:
    """Collective seq of group gid abandoned (mismatch, timeout)."""
    return {"kind": "abort", "tag": (gid, seq), "reason": reason, "message": message}


def lost(rank: int, message: str) -> dict[str, Any]:
    """World rank ``rank`` was lost: every call of the job's groups that needs it fails."""
    return {"kind": "abort", "tag": ("*", -1), "reason": "lost", "lost": rank, "message": message}


__all__ = ["abort", "data", "lost", "p2p"]
