"""The life of a collective on one rank: begun under a sequence number and a call descriptor, run
under one deadline, ended; abandoned by every rank together on a mismatch or a timeout; failed
when a peer is lost (the group is then broken) or departs while it still needed it.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np

from ..core.arrays import DTYPES, dtype_name
from ..errors import CollectiveTimeoutError, GroupClosedError, MismatchError, PeerLostError, PsringError
from ..settings import Settings
from ..transport.mailbox import Mailbox
from .collective import Collective, _absorb_cancel, _failure, after_of, describe, mismatch_message
from .recorder import OBSERVERS

logger = logging.getLogger(__name__)

#: calls each group remembers after they end (a power of two): the in-memory flight recorder the
#: stall inspector, ``psring doctor --job`` and SIGUSR1 read, and what late frames are checked against
RECENT = 64


class Recent(NamedTuple):
    """One finished call, as the flight recorder keeps it."""

    seq: int
    desc: tuple[Any, ...]
    ok: bool  # it returned here (False: it failed, or a mismatch found later was already reported)
    ended: float  # time.monotonic()


class _Ended(NamedTuple):
    """What an observer reads of a short way's call (as of a Collective)."""

    seq: int
    desc: tuple[Any, ...]
    started: float


class RecvWait:
    """A recv in progress: since when, and an error the stall inspector set to end it."""

    __slots__ = ("error", "stalled", "started")

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.stalled = 0
        self.error: PsringError | None = None


class Ticket:
    """A call numbered off the loop (a short way: the boards, the TCP one- and two-hop calls, the data
    plane): the runtime makes it (:meth:`CollectiveRuntime.ticket`) and closes it
    (:meth:`CollectiveRuntime.close_number`), or the loop adopts its number (``begin(seq=, started=)``)."""

    __slots__ = ("desc", "seq", "started")

    def __init__(self, seq: int, desc: tuple[Any, ...], started: float) -> None:
        self.seq = seq
        self.desc = desc
        self.started = started


class CollectiveRuntime(abc.ABC):
    """The base of :class:`~psring.topology.group.Group`: sequence numbers, deadlines, aborts and losses.

    It keeps the state of this rank's calls in the group (set up here, read and written only here
    and by the group's own collectives). The topologies call ``begin``/``run``, report what their
    connection layer sees (``on_abort``, ``on_peer_lost``, ``on_peer_departed``) and fill in the two
    hooks: ``send_abort`` (tell every peer) and ``_layer`` (the connection layer: its stall inspector).
    """

    #: the topology's registered name (settings.TOPOLOGY_NAMES), as the flight recorder's records carry it
    topology: ClassVar[str] = ""

    def __init__(
        self, rank: int, world_size: int, *, timeout: float, gid: str, mailbox: Mailbox, config: Settings
    ) -> None:
        #: this process's PSRING_* settings (psring.settings), as the group was made with them
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.gid = gid
        self.mailbox = mailbox
        self._seq = 0
        self._active: dict[int, Collective] = {}
        self._reserved: set[int] = set()  # numbers taken for collectives not begun yet
        self._aborted: dict[int, PsringError] = {}
        self._broken: PsringError | None = None
        self._departed: dict[int, PeerLostError] = {}  # ranks that closed cleanly
        self._departed_at: dict[int, int | None] = {}  # ... and the first seq they did not finish
        self._closed = False
        #: the flight recorder: the last RECENT calls that ended, at seq % RECENT
        self._recent: list[tuple[int, tuple[Any, ...], bool, float] | None] = [None] * RECENT  # Recent's fields
        self._late_error: MismatchError | None = None  # raised by the next collective (_found_late)
        self._after: int | None = None  # the next call's descriptor's last field (collective.after_of)
        self._reserved_after: dict[int, int] = {}  # numbers a short way took, and the after each named
        self._mismatched_at = -1  # the last call that failed here as a mismatch (_found_late)

    @abc.abstractmethod
    def _layer(self) -> Any:
        """The connection layer under this group (ring: PeerNet; ps: ServerLinks)."""

    # ------------------------------------------------------------------ state
    def check_usable(self, peer: int | None = None, receiving: bool = False, seq: int | None = None) -> None:
        """Raise if this group cannot run a collective (or, with peer, a send/recv with that rank).

        A rank that left cleanly finished every collective before the one it reported
        in its goodbye, and everything it sent has arrived: slower ranks may still run
        those collectives, and receive what it sent them, without it.
        """
        if self._closed:
            raise GroupClosedError(f"{self!r} is closed")
        if self._broken is not None:
            broken = self._broken
            message = f"{self!r} is broken: {broken}"
            if isinstance(broken, PeerLostError):  # keep who was lost: callers tell servers from workers by it
                raise PeerLostError(message, rank=broken.rank) from broken
            if isinstance(broken, CollectiveTimeoutError):
                raise CollectiveTimeoutError(message, missing=broken.missing) from broken
            raise type(broken)(message) from broken
        if self._departed:
            if peer is None:
                for r, gone in self._departed.items():
                    stopped_at = self._departed_at.get(r)
                    if stopped_at is None or (self._seq if seq is None else seq) >= stopped_at:
                        raise PeerLostError(f"{self!r}: {gone}", rank=gone.rank)
            elif peer in self._departed and not receiving:
                gone = self._departed[peer]
                raise PeerLostError(f"{self!r}: {gone}", rank=gone.rank)

    def check_rank(self, r: Any, what: str) -> None:
        """ValueError unless r is a rank of this group (``what``: the argument's name)."""
        if type(r) is not int or not 0 <= r < self.world_size:
            raise ValueError(f"{what}={r!r} is not a rank of this group (0..{self.world_size - 1})")

    def departed(self, rank: int) -> PeerLostError | None:
        """Why rank left cleanly, if it did (everything it sent has arrived)."""
        return self._departed.get(rank)

    # ------------------------------------------------------------------ short ways (off the loop)
    @property
    def next_seq(self) -> int:
        """The number the next call takes."""
        return self._seq

    def quiet(self, numbered: bool = False) -> bool:
        """Nothing of the group in flight, numbered for later, or failed and not yet raised: a call may
        take a short way. ``numbered``: it is numbered with :meth:`ticket`, whose descriptor names a partial
        call before it (collective.after_of); quick ways, whose descriptors are made once per kind of
        call, take none after one."""
        return (
            not self._active
            and not self._reserved
            and not self._aborted
            and self._late_error is None
            and (numbered or self._after is None)
        )

    @property
    def troubled(self) -> bool:
        """Closed, broken, or a peer departed: what :meth:`check_usable` raises for (or lets run)."""
        return self._closed or self._broken is not None or bool(self._departed)

    @property
    def after(self) -> int | None:
        """What the next call's descriptor names of the call before it (collective.after_of), if partial."""
        return self._after

    @property
    def numbered_ahead(self) -> bool:
        """Numbers taken for calls not begun yet (a short way's on a caller's thread among them)."""
        return bool(self._reserved)

    @property
    def broken(self) -> bool:
        """A peer this group needs was lost (or it was broken otherwise): every call raises."""
        return self._broken is not None

    @property
    def broken_error(self) -> PsringError | None:
        """Why the group is broken (None: it is not)."""
        return self._broken

    def mend(self) -> None:
        """The connection layer healed what broke the group (a server shard reconnected): calls run again."""
        self._broken = None

    @property
    def interrupted(self) -> bool:
        """Broken, closed, or a call aborted by a peer: a short way's wait stops and the loop takes over."""
        return self._broken is not None or bool(self._aborted) or self._closed

    def alone(self) -> bool:
        """One call in flight and nothing numbered for later (a call alone may use the group's scratch)."""
        return len(self._active) == 1 and not self._reserved

    def active(self, seq: int) -> Collective | None:
        """Collective seq, while it runs here."""
        return self._active.get(seq)

    def take_number(self) -> int:
        """The next number, reserved, for a quick way that made its descriptor already (no call before it
        is partial: :meth:`quiet` said so); settled by :meth:`close_number` or adopted by :meth:`begin`.
        Raises what :meth:`check_usable` raises (a departed peer's calls still to run go on)."""
        if self._closed or self._broken is not None or self._departed:
            self.check_usable()
        seq = self._seq
        self._seq = seq + 1
        self._reserved.add(seq)
        return seq

    def ticket(self, x: np.ndarray, op: str) -> Ticket:
        """Number an all_reduce a short way takes (raising what :meth:`check_usable` raises). The number is
        reserved, so a peer's abort or early frame for it is kept, until :meth:`close_number` or the loop's
        adoption (``begin(seq=)``) releases it."""
        self.check_usable()
        seq = self._seq
        self._seq = seq + 1
        self._reserved.add(seq)
        after = self._after
        if after is not None:  # the call before was partial: this one names it (begin, if adopted)
            self._after = None
            self._reserved_after[seq] = after
        desc = ("all_reduce", dtype_name(x.dtype), tuple(x.shape), op, None, after)
        return Ticket(seq, desc, time.monotonic())

    def close_number(self, seq: int, desc: tuple[Any, ...], started: float, error: BaseException | None) -> None:
        """A call a short way ended (its :meth:`ticket`'s, or a quick way's number from :meth:`take_number`
        with the descriptor it made once): as :meth:`_end` would -- its number released, kept among the
        recent calls, observers told."""
        self._reserved.discard(seq)
        if self._reserved_after:
            self._reserved_after.pop(seq, None)
        self._recent[seq & (RECENT - 1)] = (seq, desc, error is None, time.monotonic())
        if error is not None:
            self._failed(seq, error)
        if OBSERVERS:
            self._observe(_Ended(seq, desc, started), error)  # type: ignore[arg-type]

    def reserve(self, k: int) -> list[int]:
        """The next k sequence numbers, taken now for collectives begun later (``begin(seq=)``)."""
        seqs = list(range(self._seq, self._seq + k))
        self._seq += k
        self._reserved.update(seqs)
        return seqs

    def give_back(self, seqs: list[int]) -> None:
        """Reserved numbers of a call whose first collective failed: ranks that made another call
        in its place never took them; give them back unless later calls took numbers since."""
        self._reserved.difference_update(seqs)
        if self._seq == seqs[-1] + 1:
            self._seq = seqs[0]

    def settle(self, seqs: list[int]) -> None:
        """Reserved numbers a call ended without beginning (every rank stopped at the same check): skipped
        alike everywhere."""
        self._reserved.difference_update(seqs)

    def ended(self, seq: int) -> bool:
        """Whether this rank is done with collective seq (neither to come nor numbered for later)."""
        return seq < self._seq and seq not in self._reserved

    def abort_mismatch(self, coll: Collective, src: Any, call: Any) -> None:
        """A peer's frame for coll names another call: abandon coll here and on every rank."""
        self.abort_everywhere(coll, self.mismatch_error(coll, src, call), "mismatch")

    def stopped_at(self) -> int:
        """The first collective seq this rank has not finished (told to peers when it leaves)."""
        first = min(self._active, default=self._seq)
        return min(first, min(self._reserved)) if self._reserved else first

    def begin(
        self,
        kind: str,
        x: np.ndarray | None = None,
        op: str | None = None,
        root: int | None = None,
        timeout: float | None = None,
        seq: int | None = None,
        started: float | None = None,
    ) -> Collective:
        """Start a collective: the next sequence number, or one reserved earlier (``seq``).

        ``started``: when the call began, if before now (a fast path that ran part of it on the
        caller's thread and hands the rest to the loop); its deadline counts from then."""
        fresh = seq is None
        if seq is None:
            self.check_usable()
            seq = self._seq
            self._seq += 1
            after = self._after  # what this rank called before (collective.after_of)
        else:
            # a number reserved earlier: by a call of several collectives (reserved after its first: no partial
            # call before it) or by a short way (ShortWays.number keeps the after it named)
            self._reserved.discard(seq)
            self.check_usable(seq=seq)
            after = self._reserved_after.pop(seq, None) if self._reserved_after else None
        dtype = dtype_name(x.dtype) if x is not None else None
        shape = tuple(x.shape) if x is not None else None
        desc = (kind, dtype, shape, op, root, after)
        if fresh:
            # set for the next call before any raise: a call abandoned here is abandoned on every rank, and
            # every rank's next call names it alike
            self._after = after_of(desc)
            if self._late_error is not None:  # see on_abort: this call is abandoned everywhere
                err, self._late_error = self._late_error, None
                self.send_abort(seq, err, "mismatch")
                self._failed(seq, err)
                raise err
        coll = Collective(self, seq, desc, self.timeout if timeout is None else timeout, started)
        pending = self._aborted.pop(seq, None)
        if pending is not None:
            self._failed(seq, pending)
            raise pending
        self._active[seq] = coll
        self.mailbox.inspect((self.gid, seq), coll.inspect)
        return coll

    def guard(self, coll: Collective, fn: Callable[..., None]) -> Callable[..., None]:
        """Wrap a receive callback: any error in it fails this collective, never the link it came on
        (a link's receive loop treats an escaping exception as a broken peer). Both topologies."""

        def callback(*args: Any) -> None:
            try:
                fn(*args)
            except PsringError as exc:
                coll.fail(exc)
            except Exception as exc:  # a bug: surface it on the collective, with its traceback in the log
                logger.exception("%r: receive callback of %s failed", self, coll.label)
                coll.fail(exc)

        return callback

    def _end(self, coll: Collective, ok: bool) -> None:
        self._active.pop(coll.seq, None)
        self._recent[coll.seq & (RECENT - 1)] = (coll.seq, coll.desc, ok, time.monotonic())  # a Recent's fields
        self.mailbox.forget((self.gid, coll.seq), drop_queued=not ok)

    def _failed(self, seq: int, error: BaseException) -> None:
        """Call seq raised here (on the loop, or a short way's: ShortWays.books).

        A mismatch reports every mismatch before it (see _found_late). And if no call has begun after it,
        the next one names no call before it (collective.after_of is for a rank that returned: this one
        raised, and told the others): where every rank raised, the next call runs as if nothing had
        happened; where a rank returned from it, that rank's next call names it and raises there."""
        if isinstance(error, MismatchError) and seq > self._mismatched_at:
            self._mismatched_at = seq
        if seq == self._seq - 1:
            self._after = None

    def in_flight(self) -> list[Collective]:
        """The calls running here now (what the stall inspector and ``psring doctor --job`` show)."""
        return list(self._active.values())

    def ended_calls(self) -> list[Recent]:
        """The calls the flight recorder remembers, in call order."""
        return sorted((Recent(*r) for r in list(self._recent) if r is not None), key=lambda r: r.seq)

    def recent(self, seq: int) -> Recent | None:
        """What this rank called as collective seq, if it has ended and is still remembered."""
        rec = self._recent[seq & (RECENT - 1)]
        return Recent(*rec) if rec is not None and rec[0] == seq else None

    async def run(self, coll: Collective, body: Any) -> Any:
        """Run a collective's body under its deadline; on any failure abandon it cleanly.

        The body runs inline in the caller's task (no task per call: small collectives
        are latency-bound). A failure from elsewhere -- a peer's abort, a mismatch, a lost
        peer, the deadline -- sets ``coll.done`` and cancels this task; the cancellation
        is turned back into that error here.
        """
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        coll.task = task
        # one timer: the stall threshold first (see _waited), the deadline when it comes sooner
        wait = coll.deadline - time.monotonic()
        stall = self.config.stall
        coll.timer = loop.call_later(stall if stall < wait else wait if wait > 0.0 else 0.0, self._waited, coll)
        error: BaseException | None = None
        try:
            if coll.done.done():  # failed before it ran (a frame already queued named a mismatch)
                body.close()
                raise _failure(coll)
            result = await body
            if coll.interrupted:  # failed from elsewhere after the body's last await
                await _absorb_cancel(task)
                raise _failure(coll)
            return result
        except asyncio.CancelledError as exc:
            if coll.interrupted and task is not None and task.uncancel() == 0:
                error = _failure(coll)
                raise error from None
            error = exc
            raise  # cancelled by the caller too
        except BaseException as exc:
            error = exc
            raise
        finally:
            if coll.timer is not None:
                coll.timer.cancel()
            coll.task = None
            coll.input_wait = None
            if not coll.done.done():
                coll.done.cancel()
            elif not coll.done.cancelled():
                coll.done.exception()  # mark retrieved
            if error is not None:
                self._failed(coll.seq, error)
            self._end(coll, error is None)
            if coll.stalled:
                self._layer().stalls.resolved(self, coll, error)
            if OBSERVERS:
                self._observe(coll, error)

    def _observe(self, coll: Collective, failed: BaseException | None) -> None:
        now_wall, now = time.time(), time.monotonic()
        kind, dtype, shape, op, root, _after = coll.desc
        nbytes = 0
        if dtype is not None and shape is not None:
            nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        settings = getattr(self._layer(), "settings", None)
        record = {
            "job": getattr(settings, "job", None),
            "seq": coll.seq,
            "gid": self.gid,
            "rank": self.rank,
            "world": self.world_size,
            "topology": self.topology,
            "kind": kind,
            "op": op,
            "root": root,
            "dtype": dtype,
            "bytes": nbytes,
            "start": now_wall - (now - coll.started),
            "end": now_wall,
            "ok": failed is None,
            "error": None if failed is None else f"{type(failed).__name__}: {failed}",
        }
        for observer in list(OBSERVERS):
            try:
                observer(record)
            except Exception:  # an observer must never break a collective
                logger.exception("psring observer %r failed", observer)

    def _waited(self, coll: Collective) -> None:
        """The timer of a call in flight: the deadline, or another stall threshold passed."""
        if coll.done.done():
            return
        left = coll.deadline - time.monotonic()
        if left <= 0.001:
            self._deadline_passed(coll)
            return
        coll.stalled += 1
        self._layer().stalls.stalled(self, coll)
        coll.timer = asyncio.get_running_loop().call_later(min(self.config.stall, left), self._waited, coll)

    def _deadline_passed(self, coll: Collective) -> None:
        if coll.done.done():
            return
        if coll.report_grace > 0:  # let the rank that knows who is silent say so first
            grace, coll.report_grace = coll.report_grace, 0.0
            asyncio.get_running_loop().call_later(grace, self._deadline_passed, coll)
            return
        missing = tuple(sorted(coll.waiting_on))
        who = f"rank(s) {', '.join(map(str, missing))}" if missing else "its peers"
        err = CollectiveTimeoutError(
            f"{coll.label} on rank {self.rank} timed out after {self.timeout:g}s waiting for {who}",
            missing=missing,
        )
        self.abort_everywhere(coll, err, "timeout")

    # --------------------------------------------------------------- failures
    def mismatch_error(self, coll: Collective, src: Any, call: Any) -> MismatchError:
        return MismatchError(mismatch_message(coll.seq, src, call, self.rank, coll.desc))

    def abort_everywhere(self, coll: Collective, err: PsringError, reason: str) -> None:
        coll.fail(err)
        self.send_abort(coll.seq, err, reason)

    @abc.abstractmethod
    def send_abort(self, seq: int, err: PsringError, reason: str) -> None:
        """Tell every peer to abandon collective ``seq`` (topology-specific fan-out)."""

    def on_abort(
        self, seq: int, reason: str, message: str, missing: Sequence[int] = (), lost: int | None = None
    ) -> None:
        """A peer abandoned collective ``seq``: fail ours, or remember it for when we get there.
        (reason "lost": worker ``lost`` went away, a PeerLostError naming it.)"""
        err: PsringError
        if reason == "mismatch":
            err = MismatchError(message)
        elif reason == "lost":
            err = PeerLostError(message, rank=lost)
        else:
            err = CollectiveTimeoutError(message, missing=tuple(missing))
        coll = self._active.get(seq)
        if coll is not None:
            coll.fail(err)
        elif seq >= self._seq or seq in self._reserved:
            self._aborted[seq] = err
            if len(self._aborted) > 10_000:  # a runaway peer: keep memory bounded
                self._aborted.pop(min(self._aborted))
        elif reason == "mismatch":
            self._found_late(seq, message)
        self.mailbox.forget((self.gid, seq), drop_queued=True)

    def _found_late(self, seq: int, message: str) -> None:
        """A mismatch in collective seq, which this rank had already returned from (a broadcast's
        root, a reduce's other ranks: their part needs nothing back). It raises the error in the
        next collective it is in or begins, and every rank abandons that one too, so all ranks
        stay on the same sequence numbers."""
        rec = self.recent(seq)
        if rec is None or not rec.ok:
            return  # failed here already, or reported already, or too long ago to matter
        self._recent[seq & (RECENT - 1)] = (seq, rec.desc, False, rec.ended)
        if self._mismatched_at > seq:
            # a later call of this rank already failed as a mismatch (on every rank: a mismatch is abandoned
            # everywhere) -- the next call after a partial one names it (collective.after_of): told already
            return
        err = MismatchError(
            f"{message} [rank {self.rank} had returned from its {describe(rec.desc)} #{seq} before the "
            f"mismatch was found: its next collective is abandoned on every rank]"
        )
        later = sorted(s for s in self._active if s > seq)
        if not later:
            self._late_error = err
            return
        for s in later:
            self._active[s].fail(err)
            self.send_abort(s, err, "mismatch")

    def on_stray(self, seq: int, call: Any, src: Any) -> bool:
        """A frame for collective seq arrived while this rank is not in it: keep it (False: drop it).

        Frames for collectives not begun yet wait for them. Frames for one this rank has ended are
        leftovers, unless they name another call than this rank made: then the two ranks made
        different calls and this rank already returned from its own (a silent wrong answer until
        now) -- a mismatch, reported to every rank.
        """
        if seq >= self._seq or seq in self._reserved:
            return True
        rec = self.recent(seq)
        if rec is not None and rec.ok and call is not None and tuple(call) != rec.desc:
            message = mismatch_message(seq, src, call, self.rank, rec.desc)
            self.send_abort(seq, MismatchError(message), "mismatch")
            self._found_late(seq, message)
        return False

    def mismatch_found(self, seq: int, message: str) -> None:
        """The stall inspector found collective seq mismatched: abandon it here and everywhere."""
        self.send_abort(seq, MismatchError(message), "mismatch")
        self.on_abort(seq, "mismatch", message)

    def on_peer_lost(self, err: PeerLostError) -> None:
        """A peer this group needs is gone: fail everything in flight, refuse new calls."""
        if self._closed:
            return
        if self._broken is None:
            self._broken = err
            log = logger.warning if self._active else logger.debug
            log("%r broken: %s", self, err)
        for coll in list(self._active.values()):
            if self._has_its_data(coll):
                continue  # everything it waited for came before the loss: it finishes (or fails on its next wait)
            lost = PeerLostError(f"{err} (while {coll.label} was pending on rank {self.rank})", rank=err.rank)
            lost.__cause__ = err.__cause__
            coll.fail(lost)

    def _has_its_data(self, coll: Collective) -> bool:
        """Whether every message ``coll`` waits for has arrived over links other than the control
        connections and it has yet to run on (a peer's crash must not fail it then: see the ring's)."""
        return False

    def on_peer_departed(self, local_rank: int, err: PeerLostError, stopped_at: int | None = None) -> bool:
        """A peer closed its connections cleanly (its process is done with the group).

        Everything it sent has arrived by then, so only a collective still waiting for
        its frames fails (returns True: the caller then tells the other ranks); later
        collectives (and send/recv with it) raise at once. A collective whose data comes
        over another link (``data_elsewhere``) that the peer finished (before ``stopped_at``)
        is left to that link: its data may still be on the way, and the link's end says
        whether all of it came.
        """
        if self._closed:
            return False
        self._departed.setdefault(local_rank, err)
        self._departed_at.setdefault(local_rank, stopped_at)
        hurt = False
        for coll in list(self._active.values()):
            if local_rank in coll.waiting_on:
                if coll.data_elsewhere and stopped_at is not None and coll.seq < stopped_at:
                    continue
                lost = PeerLostError(f"{err} (while {coll.label} was pending on rank {self.rank})", rank=err.rank)
                coll.fail(lost)
                hurt = True
        return hurt
