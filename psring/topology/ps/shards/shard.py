"""Parameter-server shards: the server side of the ``ps`` topology.

A shard owns one slice of every tensor (see :func:`plan`). For a collective each
worker first sends a *join* frame (its call descriptor, its rank in the group and the
group's size), then its pieces. The shard checks every join against the first (a
difference is a ``MismatchError`` for every worker), reduces each piece once all N
workers have pushed it -- folding in the ring's canonical order, so both topologies
return the same bits -- and streams the result piece to the workers that want it
the moment it is folded. Relay collectives (broadcast, all_gather, gather, scatter,
send/recv) forward pieces instead of folding them.

Workers on the shard's host push pieces through shared memory (psring.transport.shmpool): the
shard holds each worker's slot until the piece is folded (or forwarded), folds straight
out of the slots into a slot of its process's own pool, and lends that one slot to
every worker that wants the result; a relayed piece is copied once into such a slot.
A worker that does not map the pool gets a copy on its socket.

A shard never falls over because of one client: a malformed frame or a frame that
contradicts the plan gets that worker an error frame and the connection dropped; a
worker that stops reading is dropped when its unsent backlog passes a bound; a
worker whose pushes pile up is paused (TCP backpressure) until others catch up. A
worker that is lost mid-collective is named to every other worker.

Parameter mode (``ps_param`` frames) keeps parameters and optimizer state on the
shard: see :class:`ParamStore`.

One process hosts one or more shards behind one listening port.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from .... import settings as settings_mod
from ....core import wire
from ....core.arrays import dtype_name, pooled_bytes
from ....core.fold import Layout, host_layout
from ....errors import PeerLostError, ProtocolError, PsringError
from ....settings import Settings
from ....transport.connection import Connection
from ....transport.samehost import elsewhere
from ....transport.tcpsocket import limit_send_buffer
from ...collective import mismatch_message
from .. import frames
from ..plan import FOLD_KINDS, may_need
from .folding import Folding
from .paramstore import handle_param
from .pending import _Pending, join_mismatch, read_join
from .relay import release_held
from .tables import tables_of

#: the largest send buffer a worker may ask a shard to keep for its connection (a ps_link frame)
MAX_SNDBUF = 256 << 20

logger = logging.getLogger(__name__)


class Shard:
    """One parameter-server shard (several may share a process and its port)."""

    def __init__(self, index: int, shards: int, job: str, settings: Settings | None = None) -> None:
        self.settings = settings or settings_mod.current()
        self.index = index
        self.shards = shards
        self.job = job
        self.pending: dict[tuple[str, int], _Pending] = {}
        self.finished: collections.OrderedDict[tuple[str, int], str] = collections.OrderedDict()
        self.lost_in: dict[tuple[str, int], int] = {}  # finished "lost": the worker whose loss ended it
        self.by_rank: dict[int, Connection] = {}  # global worker rank -> its connection to this shard
        self.conns: set[Connection] = set()
        self.gone: dict[int, str] = {}  # ranks of the main group that left or were lost
        self.gone_at: dict[int, int | None] = {}  # ... and the first main-group seq they did not finish
        self.frames_in = 0
        self.params: Any = None  # ParamStore, created on first use
        self.tables: Any = None  # Tables (sparse rows), created on first use
        self.idle = asyncio.Event()
        self.idle.set()
        self._layouts: dict[tuple[int, ...], Layout | None] = {}
        #: what it does with the pieces of a collective: folds, forwards, paces the workers
        self.folding = Folding(self.settings, self.index, self.shards, self.layout_of, self._finish)

    def __repr__(self) -> str:
        return f"Shard({self.index}/{self.shards}, job={self.job})"

    def layout_of(self, ranks: Sequence[int]) -> Layout | None:
        """The two-level order's hosts for a fold over these ranks' parts (by position), as the ring
        would fold them: only when every one of them told its host and none turned the order off."""
        key = tuple(ranks)
        if key not in self._layouts:
            hosts: list[str | None] = []
            for r in key:
                conn = self.by_rank.get(r)
                where = conn.peer.get("where") if conn is not None else None
                ok = (
                    isinstance(where, (list, tuple))
                    and len(where) == 2
                    and isinstance(where[0], str)
                    and where[1] != "off"
                )
                hosts.append(where[0] if ok else None)  # type: ignore[index]
            self._layouts[key] = host_layout(hosts)
        return self._layouts[key]

    # ---------------------------------------------------------- connections
    def attach(self, conn: Connection) -> None:
        rank: Any = conn.peer.get("rank")  # wire values, checked below
        world: Any = conn.peer.get("world_size")
        if type(rank) is not int or rank < 0 or type(world) is not int or world < 1:
            raise ProtocolError(f"worker hello claims rank {rank!r} of a world of {world!r}")
        # a rank outside its world is no member: it may talk to the shard, but no collective
        # waits for it and its loss is nobody's business; members must agree on the world
        worlds: set[Any] = {
            c.peer.get("world_size") for r, c in self.by_rank.items() if c.is_open and r < c.peer["world_size"]
        }
        if rank < world and worlds and world not in worlds:
            raise ProtocolError(
                f"rank {rank} says job {self.job!r} has {world} ranks; the ranks connected to shard "
                f"{self.index} say {sorted(worlds)}"
            )
        old = self.by_rank.get(rank)
        if old is not None and old.is_open and old is not conn:
            raise ProtocolError(f"rank {rank} is already connected to shard {self.index} from {old.peername}")
        self.by_rank[rank] = conn
        if self.settings.ps_sndbuf and elsewhere(conn.peer.get("host")):
            limit_send_buffer(conn, self.settings.ps_sndbuf)  # PSRING_PS_SNDBUF: a worker on another host
        self._layouts.clear()
        self.gone.pop(rank, None)
        self.gone_at.pop(rank, None)
        self.conns.add(conn)
        self.idle.clear()

    def detach(self, conn: Connection, error: PeerLostError | None) -> None:
        self.conns.discard(conn)
        self.folding.buffered.pop(conn, None)
        rank: Any = conn.peer.get("rank")
        attached = type(rank) is int and self.by_rank.get(rank) is conn
        member = attached and rank < conn.peer["world_size"]
        if attached:  # members and strangers alike: nothing keeps a closed connection
            del self.by_rank[rank]
        if not self.conns:
            self.idle.set()
        if attached and self.params is not None:  # elastic parameter buckets go on without it (joiners too)
            self.params.on_worker_lost(rank, lost=error is not None)
        if attached and self.tables is not None:  # and elastic sparse tables
            self.tables.on_worker_lost(rank)
        dropped = error is not None and isinstance(error.__cause__, ProtocolError)  # our own doing
        # a worker that said goodbye reports, per group, the first collective it did not
        # finish: the ones before it need nothing more from it, whoever has yet to join them
        seqs = (conn.farewell or {}).get("seqs") if error is None else None
        seqs = seqs if isinstance(seqs, dict) else {}

        def finished(p: _Pending) -> bool:
            at = seqs.get(p.gid)
            return type(at) is int and p.seq < at

        needed = [
            key for key, p in self.pending.items() if any(c is conn for c in p.conns.values()) and not finished(p)
        ]
        if member:
            needed += [
                key for key, p in self.pending.items() if p.gid == "0" and rank not in p.conns and not finished(p)
            ]
        if error is None or dropped:
            how = f"rank {rank} left (closed its connection)" if error is None else f"rank {rank} was dropped: {error}"
            if member:
                self.gone[rank] = how
                at = seqs.get("0")
                self.gone_at[rank] = at if type(at) is int else None
            if not needed:
                return  # nothing outstanding needs it: later collectives that do are told at their join
            how += f" while {self.pending[needed[0]].label} still needed it"
        else:
            how = f"rank {rank} at {conn.peername} was lost: {error}"
            if member:
                self.gone[rank] = how
                self.gone_at[rank] = None
                # any pending call may need it -- but a group of an elastic job's live workers names its
                # members (SyncSGD.live_group): one without it goes on (its late joiners would not hear)
                needed = [key for key, p in self.pending.items() if may_need(p.gid, rank)]
            elif not needed:
                return
        self._report_lost(rank, how)
        for key in needed:
            self._finish(key, "lost", lost=rank if type(rank) is int else None)

    def _left_before(self, rank: int, seq: int) -> bool:
        """Whether gone rank left before finishing main-group collective seq."""
        at = self.gone_at.get(rank)
        return at is None or seq >= at

    def _report_lost(self, rank: Any, how: str) -> None:
        header = frames.abort(("*", -1), "lost", how, lost=rank)
        for other in list(self.conns):
            with contextlib.suppress(PsringError):
                other.send_frame(dict(header))

    # ------------------------------------------------------------- frames in
    def buffer_for(self, conn: Connection, header: dict[str, Any]) -> memoryview | None:
        # each piece is read straight into a buffer of its own, recycled once folded and sent
        if header["kind"] == "ps_data" and header["nbytes"] >= POOLED_MIN:
            return memoryview(pooled_bytes(header["nbytes"]))  # type: ignore[arg-type]  # numpy arrays are buffers
        return None

    def deliver(self, conn: Connection, header: dict[str, Any], payload: Any) -> None:
        self.frames_in += 1
        kind = header["kind"]
        try:
            if kind == "ps_req":
                self._on_join(conn, header)
            elif kind == "ps_data":
                if header.get("to") is not None:
                    self._relay_p2p(conn, header, payload)
                else:
                    self._on_data(conn, header, payload)
            elif kind == "abort":
                self._on_abort(conn, header)
            elif kind == "ps_param":
                if str(header.get("op", "")).startswith("sp_"):  # a sparse table's rows
                    tables_of(self).handle(conn, header, payload)
                else:
                    handle_param(self, conn, header, payload)
            elif kind == "stall":
                self._relay_stall(header)
            elif kind == "ps_link":
                on_link(self.settings, conn, header)
            else:
                raise ProtocolError(f"a {kind!r} frame means nothing to a parameter server")
        except ProtocolError as exc:
            self._reject(conn, str(exc))

    def _reject(self, conn: Connection, message: str) -> None:
        logger.warning("%r: dropping rank %s (%s): %s", self, conn.peer.get("rank"), conn.peername, message)
        with contextlib.suppress(PsringError):
            conn.send_frame(frames.reject(f"server shard {self.index}: {message}"))
        asyncio.get_running_loop().call_later(0.05, conn.abort, ProtocolError(message))

    def _on_join(self, conn: Connection, header: dict[str, Any]) -> None:
        settings = self.settings
        join = read_join(header, self.shards, settings.ps_piece, settings.max_frame, settings.max_tensor)
        key, desc, src = join.key, join.desc, join.src
        if key in self.finished:
            if self.finished[key] != "done":  # abandoned: tell the latecomer at once
                lost = self.lost_in.get(key)
                why = f": {self.gone[lost]}" if lost in self.gone else ""
                self.send_abort(conn, key, self.finished[key], f"{desc[0]} #{key[1]} was abandoned{why}", lost=lost)
            return
        pending = self.pending.get(key)
        if pending is None:
            gone = [r for r in self.gone if r < join.size and self._left_before(r, key[1])] if key[0] == "0" else []
            if gone:  # it can never complete: say so now rather than at the deadline
                conn.send_frame(frames.abort(("*", -1), "lost", self.gone[gone[0]], lost=gone[0]))
                # its data frames are already on the way (a worker sends them right behind the
                # join): they and any later join must meet an abandoned collective, not a stranger
                self._finish(key, "lost", lost=gone[0])
                return
            pending = _Pending(key[0], key[1], desc, join.size, src, self.index, self.shards, join.piece, join.weights)
            pending.ordered = join.ordered
            self.pending[key] = pending
        else:
            message = join_mismatch(join, pending)
            if message is not None:
                self._abort_all(key, "mismatch", message)
                return
        if src in pending.conns and pending.conns[src] is not conn:
            raise ProtocolError(f"two workers claim rank {src} of group {key[0]}")
        pending.conns[src] = conn
        if len(pending.conns) == pending.size:
            held, pending.waiting = pending.waiting, []
            for src_, j, data, hdr in held:
                if pending.kind == "scatter":
                    self.folding.send_row(pending, src_, data, hdr)
                else:
                    self.folding.account(pending.conns[src_], -data.nbytes)
                    self.folding.forward(pending, src_, j, data, hdr)
                    release_held(pending.held.pop(("w", src_, j), ()))
            self.folding.maybe_finish(pending)

    def _on_data(self, conn: Connection, header: dict[str, Any], payload: Any) -> None:
        tag: Any = header["tag"]  # wire values, checked below
        src: Any = header.get("src")
        if not (len(tag) == 4 and isinstance(tag[0], str) and type(tag[1]) is int and type(tag[3]) is int):
            raise ProtocolError(f"data frame with a malformed tag {tag!r}")
        key = (tag[0], tag[1])
        if key in self.finished:
            return  # an abandoned collective's stragglers
        pending = self.pending.get(key)
        if pending is None or pending.conns.get(src) is not conn:
            raise ProtocolError(f"rank {src} sent data for #{tag[1]} of group {tag[0]} before joining it")
        if header.get("call") != pending.desc:
            self._abort_all(
                key, "mismatch", mismatch_message(key[1], src, header.get("call"), pending.first, pending.desc)
            )
            return
        j = tag[3]
        if pending.kind == "scatter":
            self.folding.scatter_row(pending, conn, header, payload)
            return
        if not 0 <= j < len(pending.pieces):
            raise ProtocolError(
                f"piece {j} of {pending.label} is out of range (this shard has {len(pending.pieces)}"
                f" of {pending.piece_bytes} bytes)"
            )
        pa, pb = pending.pieces[j]
        assert pending.dtype is not None
        wire_dtype = pending.codec.wire if pending.codec else pending.dtype
        want = (pb - pa) * wire_dtype.itemsize
        if header["nbytes"] != want or header.get("dtype") != dtype_name(wire_dtype):
            raise ProtocolError(
                f"piece {j} of {pending.label} from rank {src} has {header['nbytes']} bytes of "
                f"{header.get('dtype')}, expected {want} bytes of {dtype_name(wire_dtype)}"
            )
        data = np.frombuffer(payload, dtype=wire_dtype, count=pb - pa)
        if pending.kind in FOLD_KINDS:
            box = pending.inbox.setdefault(j, {})
            if src in box:
                raise ProtocolError(f"rank {src} pushed piece {j} of {pending.label} twice")
            box[src] = data
            if "pool" in header:  # it stays in the worker's shared memory until folded
                pending.held.setdefault(j, []).append((conn, conn.hold_slot()))
            self.folding.account(conn, data.nbytes)
            if len(box) == pending.size:
                self.folding.fold(pending, j, box)
        else:
            if pending.kind == "broadcast" and src != pending.root:
                raise ProtocolError(f"rank {src} pushed data for a broadcast from rank {pending.root}")
            if len(pending.conns) < pending.size:
                pending.waiting.append((src, j, data, header))
                if "pool" in header:  # it stays in the worker's shared memory until forwarded
                    pending.held.setdefault(("w", src, j), []).append((conn, conn.hold_slot()))
                self.folding.account(conn, data.nbytes)
                return
            self.folding.forward(pending, src, j, data, header)

    def _finish(self, key: tuple[str, int], outcome: str, lost: int | None = None) -> None:
        pending = self.pending.pop(key, None)
        if pending is not None:
            for held in pending.held.values():
                release_held(held)
            pending.held.clear()
            for conn in pending.conns.values():
                unfolded = sum(b[r].nbytes for b in pending.inbox.values() for r in b if pending.conns.get(r) is conn)
                if unfolded:
                    self.folding.account(conn, -unfolded)
        self.finished[key] = outcome
        if lost is not None:
            self.lost_in[key] = lost
        while len(self.finished) > 10_000:
            self.lost_in.pop(self.finished.popitem(last=False)[0], None)

    # ------------------------------------------------------------- aborts
    def _abort_all(self, key: tuple[str, int], reason: str, message: str, missing: list[int] | None = None) -> None:
        header = frames.abort(key, reason, message, missing=missing or [])
        for conn in list(self.conns):
            with contextlib.suppress(PsringError):
                conn.send_frame(dict(header))
        self._finish(key, reason)

    def send_abort(
        self, conn: Connection, key: tuple[str, int], reason: str, message: str, lost: int | None = None
    ) -> None:
        """Collective key was abandoned (reason: mismatch, timeout, or lost: worker ``lost`` went away)."""
        header = frames.abort(key, reason, message, missing=[], **({"lost": lost} if lost is not None else {}))
        with contextlib.suppress(PsringError):
            conn.send_frame(header)

    def _on_abort(self, conn: Connection, header: dict[str, Any]) -> None:
        tag, reason = header.get("tag"), header.get("reason")
        if not (isinstance(tag, tuple) and len(tag) == 2 and reason in ("timeout", "mismatch")):
            raise ProtocolError("malformed abort frame")
        key = (tag[0], tag[1])
        if key in self.finished and self.finished[key] != "done":
            return
        pending = self.pending.get(key)
        if reason == "timeout" and pending is None:
            # not one of this collective's shards (a small tensor lives on one): it cannot say who
            # is missing, and an answer from it could reach the workers before the shard that can
            return
        message = str(header.get("message", ""))[:2000]
        missing: list[int] = []
        if reason == "timeout" and pending is not None:
            missing = self._missing(pending)
            who = f"rank(s) {', '.join(map(str, missing))}" if missing else "its peers"
            message = (
                f"{pending.label} timed out after {header.get('timeout', '?')}s on rank {header.get('src')} "
                f"waiting for {who} (server shard {self.index} has nothing from them)"
            )
        self._abort_all(key, reason, message, missing)

    def _missing(self, pending: _Pending) -> list[int]:
        absent = set(range(pending.size)) - set(pending.conns)
        if pending.kind in FOLD_KINDS:
            for box in pending.inbox.values():
                absent |= set(range(pending.size)) - set(box)
        return sorted(absent)

    def _relay_stall(self, header: dict[str, Any]) -> None:
        """The workers' stall inspector talks through the shards: its frames go to the ranks in ``to``."""
        to = header.get("to")
        if not isinstance(to, tuple) or not all(type(r) is int for r in to):
            raise ProtocolError(f"stall frame to a malformed list of ranks {to!r}")
        for r in to:
            target = self.by_rank.get(r)
            if target is not None and target.is_open:
                with contextlib.suppress(PsringError):
                    target.send_frame(dict(header))

    # ------------------------------------------------------------- p2p
    def _relay_p2p(self, conn: Connection, header: dict[str, Any], payload: Any) -> None:
        to = header.get("to")
        if type(to) is not int:
            raise ProtocolError(f"send relayed to a malformed rank {to!r}")
        target = self.by_rank.get(to)
        if target is None or not target.is_open:
            raise ProtocolError(f"send to rank {to}, which is not connected to shard {self.index}")
        if "dtype" not in header:
            raise ProtocolError("relayed send carries no array")
        data = wire.decode_tensor(header, payload)
        fwd = {k: v for k, v in header.items() if k not in ("to", "nbytes", "dtype", "shape")}
        self.folding.send(target, fwd, data)


#: pieces from this size are received into (and folded into) pooled buffers
POOLED_MIN = 1 << 20


__all__ = ["Shard"]


def on_link(settings: Settings, conn: Connection, header: dict[str, Any]) -> None:
    """A worker's word on its link: a probe, answered at once (its payload is only timed), or the
    send buffer its job chose for links to other hosts (kept at this end where PSRING_PS_SNDBUF here
    is auto)."""
    tag: Any = header.get("tag")
    sndbuf: Any = header.get("sndbuf")
    if tag is not None:
        if not isinstance(tag, tuple) or len(tag) != 2 or tag[0] != "link":
            raise ProtocolError(f"a ps_link probe with tag {tag!r}")
        conn.send_frame(frames.link(tag))
    elif type(sndbuf) is not int or not 0 < sndbuf <= MAX_SNDBUF:
        raise ProtocolError(f"a ps_link frame names send buffer {sndbuf!r} (1 to {MAX_SNDBUF} bytes)")
    elif settings.ps_sndbuf is None and elsewhere(conn.peer.get("host")):
        limit_send_buffer(conn, sndbuf)
