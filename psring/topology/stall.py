"""The stall inspector: when a call has waited ``PSRING_STALL_S``, the ranks compare what they called.

Nothing extra moves while nothing stalls. Each group keeps its last calls in memory (the flight
recorder, ``Group.ended_calls``, beside the calls in flight); a call that has waited one stall threshold
asks the other ranks of its group for theirs -- a ``stall`` frame over the links the rank already
has: straight to each rank on the ring, through a server shard on ps -- and judges what comes back:

- two ranks made different calls as the same collective (kind, dtype, shape, op or root differ):
  a **mismatch**, whether or not some of them have returned from theirs;
- ranks that have not reached the call wait in another psring call that waits on the ranks in this
  one (a recv from them, a collective of another group): a **deadlock**, named as a mismatch too;
- otherwise a rank is simply not there yet (computing, or its event loop busy): a **stall**, one
  warning per threshold naming it; the group timeout still ends the wait.

A mismatch is abandoned on every rank (the ordinary abort, so the group stays usable); a deadlocked
recv is ended with the same error. What the inspector saw goes to the store (``psring/<job>/stall``)
for ``psring doctor --job``, and SIGUSR1 prints this process's calls to stderr.

A rank whose every psring call waits is taken to wait on nothing else: a task of its own that
would still send, after ``PSRING_STALL_S``, is not foreseen.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from ..errors import MismatchError
from ..transport import traffic
from ..transport.loop import dump_tasks
from .collective import Collective, describe

logger = logging.getLogger(__name__)

#: seconds an inspection waits for the other ranks' answers (a rank whose loop is busy gives none)
ASK_WAIT = 0.5
#: ended calls per group a rank shows (the newest)
SHOWN = 16

_inspectors: weakref.WeakSet[StallInspector] = weakref.WeakSet()
#: callables ``cb(verdict)`` ("stall" or "mismatch") told of every verdict this process reaches
#: (the daemons' Prometheus counter)
STALL_OBSERVERS: list[Callable[[str], None]] = []


# ---------------------------------------------------------------- what a rank is doing
def snapshot(layer: Any) -> dict[str, Any]:
    """This process's calls in every group of one connection layer: in flight and recently ended."""
    now = time.monotonic()
    groups: list[Any] = []
    recvs: list[Any] = []
    for gid, g in list(layer.groups.items()):
        calls: list[Any] = []
        for seq, desc, ok, at in g.ended_calls()[-SHOWN:]:
            calls.append([seq, list(desc), "done" if ok else "failed", round(now - at, 3), []])
        for c in g.in_flight():
            waiting_on = sorted(g.members[r] for r in c.waiting_on if 0 <= r < len(g.members))
            calls.append([c.seq, list(c.desc), "waiting", round(now - c.started, 3), waiting_on])
        groups.append([gid, list(g.members), g.next_seq, calls])
        for (src, n), wait in list(g.p2p.waits.items()):
            recvs.append([gid, g.members[src], n, round(now - wait.started, 3)])
    return {"rank": layer.rank, "host": socket.gethostname(), "pid": os.getpid(), "groups": groups, "recvs": recvs}


@dataclass
class Call:
    seq: int
    desc: tuple[Any, ...]
    status: str  # waiting, done, failed
    age: float  # seconds waiting, or since it ended
    waiting_on: tuple[int, ...]  # world ranks a waiting call still expects data from


@dataclass
class GroupView:
    members: tuple[int, ...]
    next: int  # the sequence number its next collective takes
    calls: dict[int, Call]


@dataclass
class Blocked:
    """One call a rank waits in: a collective (seq, desc) or a recv (src, a world rank)."""

    gid: str
    seq: int | None = None
    desc: tuple[Any, ...] = ()
    src: int | None = None
    age: float = 0.0


@dataclass
class View:
    """One rank's snapshot, as the inspector reads it."""

    rank: int
    host: str
    pid: int
    groups: dict[str, GroupView]
    recvs: list[Blocked]

    def blocked(self) -> list[Blocked]:
        calls = [
            Blocked(gid, c.seq, c.desc, age=c.age)
            for gid, g in self.groups.items()
            for c in g.calls.values()
            if c.status == "waiting"
        ]
        return calls + self.recvs


def _norm(desc: Any) -> tuple[Any, ...]:
    return tuple(tuple(v) if isinstance(v, (list, tuple)) else v for v in desc)


def read_view(state: Any) -> View | None:
    """A snapshot that came over the wire (None if it is not one)."""
    try:
        groups = {}
        for gid, members, nxt, calls in state["groups"]:
            table = {}
            for seq, desc, status, age, on in calls:
                table[int(seq)] = Call(int(seq), _norm(desc), str(status), float(age), tuple(int(r) for r in on))
            groups[str(gid)] = GroupView(tuple(int(m) for m in members), int(nxt), table)
        recvs = [Blocked(str(gid), src=int(src), age=float(age)) for gid, src, _n, age in state["recvs"]]
        return View(int(state["rank"]), str(state["host"]), int(state["pid"]), groups, recvs)
    except (KeyError, TypeError, ValueError):
        return None


# ---------------------------------------------------------------- judging
@dataclass
class Verdict:
    mismatch: bool
    message: str
    aborts: list[tuple[str, int]] = field(default_factory=list)  # (gid, seq) every rank abandons
    recvs: list[tuple[int, str, int]] = field(default_factory=list)  # (rank waiting, gid, src) to end


RULE = "every rank must make the same calls, with the same arguments, in the same order"


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _of(gid: str) -> str:
    return "" if gid == "0" else f" of group {gid}"


def _members(views: dict[int, View], gid: str) -> tuple[int, ...]:
    for v in views.values():
        if gid in v.groups:
            return v.groups[gid].members
    return ()


def _absent(views: dict[int, View], gid: str, seq: int) -> set[int]:
    """The members of gid that, by their snapshots, have not made collective seq (nor can have)."""
    absent = set()
    for m in _members(views, gid):
        v = views.get(m)
        if v is None:
            continue  # no answer: nothing known
        g = v.groups.get(gid)
        if g is None or (seq not in g.calls and g.next <= seq):
            absent.add(m)
    return absent


def _waits_on(b: Blocked, views: dict[int, View]) -> set[int]:
    """The ranks a blocked call waits on to make a call of theirs: a recv on its sender, a collective
    on the members that have not made it. (A collective every member made waits on data only.)"""
    if b.src is not None:
        return {b.src}
    return _absent(views, b.gid, b.seq) if b.seq is not None else set()


def deadlocked(views: dict[int, View]) -> set[int]:
    """The ranks that can never move on: every call each of them waits in waits on a rank among them.

    The largest such set (start from every waiting rank, drop one whose some call waits on nobody
    left in the set, until none drops). A rank that did not answer is never in it."""
    stuck = {r for r, v in views.items() if v.blocked()}
    changed = True
    while changed:
        changed = False
        for r in sorted(stuck):
            if any(not (_waits_on(b, views) & stuck) for b in views[r].blocked()):
                stuck.discard(r)
                changed = True
    return stuck


def _blocked_text(b: Blocked, views: dict[int, View]) -> str:
    members = _members(views, b.gid)
    if b.src is not None:
        src = members.index(b.src) if b.src in members else b.src
        return f"recv(src={src}){_of(b.gid)}"
    return f"{describe(b.desc)} #{b.seq}{_of(b.gid)}"


def _local(views: dict[int, View], gid: str, ranks: set[int] | list[int]) -> list[int]:
    members = _members(views, gid)
    return sorted(members.index(r) if r in members else r for r in ranks)


def judge(asker: int, views: dict[int, View], gid: str, seq: int | None = None, src: int | None = None) -> Verdict:
    """What stalls rank asker's call in group gid: collective ``seq``, or a recv from world rank ``src``."""
    me = views[asker].groups[gid]
    members = me.members
    if seq is not None:
        found = _different_calls(views, gid, seq)
        if found is not None:
            return found
    stuck = deadlocked(views)
    if asker in stuck:
        return _deadlock(views, stuck)
    if seq is not None:
        return _late_ranks(asker, views, gid, seq)
    assert src is not None
    waited = max((b.age for b in views[asker].recvs if b.gid == gid and b.src == src), default=0.0)
    here = f"recv(src={members.index(src)}){_of(gid)} has waited {waited:.1f}s on rank {members.index(asker)}"
    other = views.get(src)
    if other is None:
        return Verdict(False, f"{here}: rank {members.index(src)} did not answer")
    doing = ", ".join(_blocked_text(b, views) for b in other.blocked())
    state = f"it waits in {doing}" if doing else "it is not in a psring call"
    return Verdict(False, f"{here}: rank {members.index(src)} has not sent ({state})")


def _different_calls(views: dict[int, View], gid: str, seq: int) -> Verdict | None:
    """Two members made different calls as one collective: this one first, then any both remember."""
    members = _members(views, gid)

    def call(m: int, s: int) -> Call | None:
        v = views.get(m)
        g = v.groups.get(gid) if v is not None else None
        return g.calls.get(s) if g is not None else None

    seqs = sorted({s for m in members if m in views and gid in views[m].groups for s in views[m].groups[gid].calls})
    for s in [seq, *(s for s in seqs if s != seq)]:
        made: dict[tuple[Any, ...], list[int]] = {}
        for m in members:
            c = call(m, s)
            if c is not None:  # (the call alone: where only the call before differs, that one is named)
                made.setdefault(tuple(c.desc[:5]), []).append(members.index(m))
        if len(made) > 1:
            detail = len({describe(d) for d in made}) < len(made)  # kind, op and root agree: dtype or shape do not
            order = sorted(made.items(), key=lambda kv: (len(kv[1]), min(kv[1])))
            text = ", ".join(f"{_ranks(rs)} called {describe(d, detail)} #{s}" for d, rs in order)
            returned = [members.index(m) for m in members if (c := call(m, s)) is not None and c.status == "done"]
            note = f" ({_ranks(returned)} had returned from it)" if returned else ""
            return Verdict(True, f"{text}{_of(gid)}{note}: {RULE}", aborts=[(gid, s)])
    return None


def _deadlock(views: dict[int, View], stuck: set[int]) -> Verdict:
    """Every rank in stuck waits on another: name each one's calls, and end them all."""
    verdict = Verdict(True, "")
    parts: dict[str, list[int]] = {}
    for r in sorted(stuck):
        texts = []
        for b in views[r].blocked():
            text = _blocked_text(b, views)
            if b.src is not None:
                verdict.recvs.append((r, b.gid, b.src))
            elif b.seq is not None:
                verdict.aborts.append((b.gid, b.seq))
                text += f", which {_ranks(_local(views, b.gid, _absent(views, b.gid, b.seq)))} never called"
            texts.append(text)
        parts.setdefault("; ".join(texts), []).append(r)
    verdict.aborts = sorted(set(verdict.aborts))
    verdict.recvs = sorted(set(verdict.recvs))
    lines = [f"{_ranks(rs)} {'waits' if len(rs) == 1 else 'wait'} in {text}" for text, rs in parts.items()]
    subgroup = any(gid != "0" for gid, _seq in verdict.aborts) or any(g != "0" for _r, g, _s in verdict.recvs)
    ranks = " (ranks of the whole job; calls' ranks as their group numbers them)" if subgroup else ""
    verdict.message = f"{'; '.join(lines)}{ranks}: a deadlock ({RULE}, and every recv needs its send)"
    return verdict


def _late_ranks(asker: int, views: dict[int, View], gid: str, seq: int) -> Verdict:
    """Collective seq waits for ranks that are not there yet: a stall to warn about, not an error."""
    me = views[asker].groups[gid]
    members = me.members
    waited = me.calls[seq].age if seq in me.calls else 0.0
    this = f"{describe(me.calls[seq].desc)} #{seq}{_of(gid)}" if seq in me.calls else f"#{seq}{_of(gid)}"
    where = f"has waited {waited:.1f}s on rank {members.index(asker)}"
    absent = _absent(views, gid, seq) | {m for m in members if m not in views}
    if not absent:
        on = me.calls[seq].waiting_on if seq in me.calls else ()
        extra = f"; waiting for data from {_ranks(_local(views, gid, set(on)))}" if on else ""
        return Verdict(False, f"{this} {where}: every rank called it{extra}")
    notes = []
    for m in sorted(absent):
        v = views.get(m)
        if v is None:
            notes.append(f"rank {members.index(m)} did not answer (its event loop is busy, or it is gone)")
        elif v.blocked():
            notes.append(f"rank {members.index(m)} waits in " + ", ".join(_blocked_text(b, views) for b in v.blocked()))
        else:
            notes.append(f"rank {members.index(m)} is not in a psring call")
    verb = "has" if len(absent) == 1 else "have"
    return Verdict(
        False, f"{this} {where}: {_ranks(_local(views, gid, absent))} {verb} not called it ({'; '.join(notes)})"
    )


# ---------------------------------------------------------------- the inspector
class _Ask:
    def __init__(self, want: set[int]) -> None:
        self.want = want
        self.states: dict[int, View] = {}
        self.complete = asyncio.Event()


class StallInspector:
    """One per connection layer (a ring PeerNet, a ps ServerLinks): asks, answers and judges.

    ``send(ranks, frame)`` gets a ``stall`` frame to those world ranks (ring: on a link to each;
    ps: through a shard, which relays it to the ranks in its ``to``). A reply goes back on the
    connection the ask came in on, with ``to`` naming the asker.
    """

    def __init__(self, layer: Any, send: Callable[[list[int], dict[str, Any]], Awaitable[None]]) -> None:
        self.layer = layer
        self._send = send
        self._ids = itertools.count()
        self._asks: dict[tuple[int, int], _Ask] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._published = False
        _inspectors.add(self)

    # the groups' hooks ------------------------------------------------
    def stalled(self, group: Any, coll: Collective | None = None, recv: tuple[int, int, Any] | None = None) -> None:
        """A call passed another stall threshold (from a timer or a recv's poll): inspect it."""
        if len(group.members) < 2:
            return
        moving = False
        if coll is not None:  # bulk moved since it began or was last looked at: a slow transfer (a thin link)
            moving, coll.bulk_mark = traffic.moving(coll.bulk_mark), traffic.received()
        task = asyncio.get_running_loop().create_task(self._inspect(group, coll, recv, moving))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def resolved(self, group: Any, coll: Collective | None, error: BaseException | None) -> None:
        """A call that had stalled ended: the picture in the store is old now (unless it failed)."""
        if (
            error is None
            and self._published
            and not any(c.stalled for g in list(self.layer.groups.values()) for c in g.in_flight())
        ):
            self._published = False
            self._spawn(self._unpublish())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # frames -----------------------------------------------------------
    def on_frame(self, conn: Any, header: dict[str, Any]) -> None:
        if "ask" in header:
            ask = header["ask"]
            reply = {"kind": "stall", "reply": ask, "to": [ask[0]], "state": snapshot(self.layer)}
            with contextlib.suppress(Exception):  # the asker may be gone
                conn.send_frame(reply)
        elif "reply" in header:
            pending = self._asks.get(tuple(header["reply"]))
            view = read_view(header.get("state"))
            if pending is not None and view is not None:
                pending.states[view.rank] = view
                if pending.want <= set(pending.states):
                    pending.complete.set()
        elif "abort" in header:
            gid, seq = header["abort"]
            group = self.layer.groups.get(gid)
            if group is not None:
                group.mismatch_found(int(seq), str(header.get("message", ""))[:4000])
        elif "fail_recv" in header:
            gid, src = header["fail_recv"]
            group = self.layer.groups.get(gid)
            if group is not None:
                group.fail_recv(src, MismatchError(str(header.get("message", ""))[:4000]))

    # one inspection ---------------------------------------------------
    async def _gather(self, group: Any) -> dict[int, View]:
        me = self.layer.rank
        want = {m for m in group.members if m != me}
        ask_id = (me, next(self._ids))
        pending = self._asks[ask_id] = _Ask(want)
        try:
            await self._send(sorted(want), {"kind": "stall", "ask": list(ask_id)})
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(ASK_WAIT):
                    await pending.complete.wait()
        finally:
            del self._asks[ask_id]
        views = dict(pending.states)
        own = read_view(snapshot(self.layer))
        assert own is not None
        views[me] = own
        return views

    async def _inspect(
        self, group: Any, coll: Collective | None, recv: tuple[int, int, Any] | None, moving: bool = False
    ) -> None:
        """Ask every rank what it waits in and judge: a mismatch is raised; a stall is warned about --
        unless bulk bytes kept arriving meanwhile (``moving``: an exchange that takes minutes on a thin
        link is not a stall; it is logged at debug level only, and neither counted nor published)."""
        try:
            views = await self._gather(group)
            if coll is not None:
                if coll.done.done():
                    return
                verdict = judge(self.layer.rank, views, group.gid, seq=coll.seq)
            else:
                assert recv is not None
                src, _n, wait = recv
                if wait.error is not None or (src, _n) not in group.p2p.waits:
                    return
                verdict = judge(self.layer.rank, views, group.gid, src=group.members[src])
            if verdict.mismatch:
                self._apply(verdict, views)
            elif moving:
                logger.debug("psring: a call waits while bulk bytes arrive (a slow transfer): %s", verdict.message)
                return
            else:
                logger.warning("psring stall: %s", verdict.message)
            for observer in list(STALL_OBSERVERS):
                observer("mismatch" if verdict.mismatch else "stall")
            await self._publish(views, verdict, group)
        except Exception:  # the inspector must never break a job
            logger.exception("psring: the stall inspector failed")

    def _apply(self, verdict: Verdict, views: dict[int, View]) -> None:
        for gid, seq in verdict.aborts:
            group = self.layer.groups.get(gid)
            if group is not None:
                group.mismatch_found(seq, verdict.message)
            else:  # a subgroup this rank is not in: its members end the call (they may never judge it
                # themselves: the verdict can end the call that made them stall before they look)
                frame = {"kind": "stall", "abort": [gid, seq], "message": verdict.message}
                self._spawn(self._send([m for m in _members(views, gid) if m != self.layer.rank], frame))
        for rank, gid, src in verdict.recvs:
            if rank == self.layer.rank:
                group = self.layer.groups.get(gid)
                if group is not None:
                    group.fail_recv(src, MismatchError(verdict.message))
            else:
                frame = {"kind": "stall", "fail_recv": [gid, src], "message": verdict.message}
                self._spawn(self._send([rank], frame))

    # the picture in the store -------------------------------------------
    async def _publish(self, views: dict[int, View], verdict: Verdict, group: Any) -> None:
        store = getattr(self.layer, "store", None)
        if store is None:
            return
        picture = {
            "time": time.time(),
            "by": self.layer.rank,
            "verdict": "mismatch" if verdict.mismatch else "stall",
            "message": verdict.message,
            "ranks": [describe_view(views[r]) for r in sorted(views)],
            "silent": sorted(set(group.members) - set(views)),
        }
        with contextlib.suppress(Exception):  # best effort: psring doctor's copy only
            await store.set(f"{self.layer.prefix}/stall", json.dumps(picture))
            self._published = True

    async def _unpublish(self) -> None:
        store = getattr(self.layer, "store", None)
        with contextlib.suppress(Exception):  # best effort: psring doctor's copy only
            if store is not None:
                await store.delete(f"{self.layer.prefix}/stall")

    async def close(self) -> None:
        """Let an inspection or a store update under way finish (briefly), then stop."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=ASK_WAIT + 0.5)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def describe_view(view: View) -> dict[str, Any]:
    """One rank's calls in words: what it waits in, and what it last finished."""
    doing = []
    for b in view.blocked():
        members = view.groups[b.gid].members if b.gid in view.groups else ()
        what = _blocked_text(b, {view.rank: view})
        if b.src is None and b.seq is not None:
            on = view.groups[b.gid].calls[b.seq].waiting_on
            if on:
                what += f" for rank(s) {', '.join(str(members.index(r)) for r in on if r in members)}"
        doing.append(f"waits {b.age:.1f}s in {what}")
    last = None
    ended = [(c.age, gid, c) for gid, g in view.groups.items() for c in g.calls.values() if c.status != "waiting"]
    if ended:
        age, gid, c = min(ended, key=lambda e: e[0])
        last = f"{describe(c.desc)} #{c.seq}{_of(gid)} {'returned' if c.status == 'done' else 'failed'} {age:.1f}s ago"
    return {"rank": view.rank, "host": view.host, "pid": view.pid, "doing": doing, "last": last}


def format_picture(picture: dict[str, Any], now: float | None = None) -> list[str]:
    """The lines ``psring doctor --job`` prints for a picture from the store."""
    age = (now or time.time()) - float(picture.get("time", 0))
    lines = [f"{picture.get('verdict')} seen by rank {picture.get('by')} {age:.0f}s ago: {picture.get('message')}"]
    for r in picture.get("ranks", []):
        doing = "; ".join(r.get("doing") or []) or "not in a psring call"
        last = f" (last: {r['last']})" if r.get("last") else ""
        lines.append(f"  rank {r.get('rank')} ({r.get('host')} pid {r.get('pid')}): {doing}{last}")
    for r in picture.get("silent", []):
        lines.append(f"  rank {r}: did not answer")
    return lines


# ---------------------------------------------------------------- SIGUSR1
def dump(out: TextIO | None = None) -> None:
    """Print what this process waits in (SIGUSR1 does this): every group's calls, every asyncio task of
    psring's loops with the chain of awaits it is suspended in, every thread's stack. Read only: safe
    from a signal handler, the process goes on. Without ``out`` it goes to stderr's file descriptor in
    one write: a signal that came while the process was writing to stderr itself (a log line) must not
    re-enter that stream (Python raises there, in whatever the process was doing)."""
    buf = io.StringIO()
    print(f"psring: pid {os.getpid()} on SIGUSR1: what it waits in", file=buf)
    for inspector in list(_inspectors):
        try:
            view = read_view(snapshot(inspector.layer))
        except RuntimeError:  # a table changed under us (the loop runs in another thread): try once more
            view = read_view(snapshot(inspector.layer))
        if view is None:
            continue
        info = describe_view(view)
        doing = "; ".join(info["doing"]) or "not in a psring call"
        last = f" (last: {info['last']})" if info["last"] else ""
        print(f"psring rank {view.rank} (pid {view.pid}): {doing}{last}", file=buf)
    dump_tasks(buf)
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sorted(sys._current_frames().items(), key=lambda item: (item[0] != main, str(names.get(item[0], item[0]))))
    for ident, frame in frames:  # the main thread first, then by name: the same order in every dump
        print(f"thread {names.get(ident, ident)} (most recent call last):", file=buf)
        print("".join(traceback.format_stack(frame)).rstrip("\n"), file=buf)
    print(f"psring: pid {os.getpid()}: end of what it waits in", file=buf)
    if out is not None:
        out.write(buf.getvalue())
        out.flush()
        return
    data = buf.getvalue().encode(errors="replace")
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(2, data) :]


def _on_sigusr1(_signum: int, _frame: Any) -> None:
    with contextlib.suppress(Exception):  # a dump that fails must not fail what the process was doing
        dump()


def install_dump_signal() -> None:
    """SIGUSR1 prints what this process waits in (only where nobody else handles SIGUSR1: its default kills)."""
    sig = getattr(signal, "SIGUSR1", None)
    if sig is None or threading.current_thread() is not threading.main_thread():
        return
    with contextlib.suppress(ValueError, OSError):
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, _on_sigusr1)


__all__ = ["StallInspector", "deadlocked", "dump", "format_picture", "install_dump_signal", "judge"]
