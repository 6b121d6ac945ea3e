"""Parameter-server shards: the server side of the ``ps`` topology.

A shard owns one slice of every tensor (see :func:`plan`). For a collective each
worker first sends a *join* frame (its call descriptor, its rank in the group and the
group's size), then its pieces. The shard checks every join against the first (a
difference is a ``MismatchError`` for every worker), reduces each piece once all N
workers have pushed it -- folding in the ring's canonical order, so both topologies
return the same bits -- and streams the result piece to the workers that want it
the moment it is folded. Relay collectives (broadcast, all_gather, gather, scatter,
send/recv) forward pieces instead of folding them.

Workers on the shard's host push pieces through shared memory (psring.shmpool): the
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
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import wire
from .arrays import DTYPES, byte_view, dtype_name, env_bytes, pooled_bytes, prod
from .compress import fold_fp16, parse_codec_op
from .connection import Connection, Listener, local_pair
from .errors import PeerLostError, ProtocolError, PsringError
from .group import SMALL_BYTES, canonical_fold, mismatch_message, ring_chunk_bounds
from .shmpool import ShmPool, host_key

logger = logging.getLogger(__name__)

#: the unit a slice is pushed, folded and pulled in (workers and shards must agree): measured
#: here side by side at N=4, S=4, 64 MiB, 4 MiB pieces were ~13% faster than 1 MiB
PIECE_BYTES = env_bytes("PSRING_PS_PIECE", 4 << 20) or 1
#: a worker whose results are not being read is dropped past this many unsent bytes
MAX_BACKLOG = env_bytes("PSRING_SERVER_BACKLOG", 1 << 30)
#: reading from a worker pauses while this many of its pushed bytes wait for the others
MAX_BUFFERED = env_bytes("PSRING_SERVER_BUFFER", 512 << 20)

#: slots (of one piece each) in the shared-memory pool of a worker, and of a server process, for
#: peers on the same host (0: none); pieces of SHARED_KINDS collectives and of parameter mode
#: from PSRING_PS_SHM_MIN bytes travel in them (see psring.shmpool)
SHM_SLOTS = env_bytes("PSRING_PS_SHM_SLOTS", 16, "slots")
SHM_MIN = env_bytes("PSRING_PS_SHM_MIN", 256 << 10)

#: the largest tensor a collective may carry (bounds the per-collective bookkeeping)
MAX_TENSOR = int(os.environ.get("PSRING_MAX_TENSOR", 64 << 30))

FOLD_KINDS = ("all_reduce", "reduce", "reduce_scatter")
RELAY_KINDS = ("broadcast", "all_gather", "gather")
KINDS = (*FOLD_KINDS, *RELAY_KINDS, "barrier", "scatter")
#: collectives whose pushes may travel in a worker's shared memory
SHARED_KINDS = (*FOLD_KINDS, *RELAY_KINDS)


# ------------------------------------------------------------------ the plan
def plan(kind: str, n: int, itemsize: int, shards: int, seq: int) -> list[tuple[int, int, int]]:
    """Which shards take part in collective #seq, and the slice [a, b) of the flat tensor each owns.

    Tensors above SMALL_BYTES are split into ``shards`` contiguous slices of equal
    size (balanced by bytes), so one huge tensor spreads over every server. Smaller
    ones, barriers and empty tensors go whole to one shard, ``seq % shards``, so
    consecutive small collectives spread over the servers too. Scatter involves
    every shard (row r travels through shard r % shards). Workers and shards compute
    this alike; every element is owned by exactly one shard.
    """
    if kind == "scatter":
        return [(s, 0, 0) for s in range(shards)]
    if kind == "barrier":
        return [(seq % shards, 0, 0)]
    if n * itemsize <= SMALL_BYTES or n < shards:
        return [(seq % shards, 0, n)]
    return [(s, s * n // shards, (s + 1) * n // shards) for s in range(shards)]


def pieces(a: int, b: int, per_piece: int) -> list[tuple[int, int]]:
    return [(s, min(s + per_piece, b)) for s in range(a, b, per_piece)]


def per_piece(itemsize: int) -> int:
    return max(1, PIECE_BYTES // max(itemsize, 1))


# ------------------------------------------------------------ collective state
class _Pending:
    """One collective on one shard: who joined, what arrived, what is left to do."""

    __slots__ = (
        "codec",
        "conns",
        "created",
        "desc",
        "done_pieces",
        "dtype",
        "first",
        "gid",
        "held",
        "inbox",
        "kind",
        "n",
        "op",
        "pieces",
        "root",
        "seq",
        "size",
        "slice",
        "total_rows",
        "waiting",
    )

    def __init__(self, gid: str, seq: int, desc: tuple[Any, ...], size: int, first: int, shard: int, shards: int):
        self.gid, self.seq, self.desc, self.size, self.first = gid, seq, desc, size, first
        kind, dtype, shape, op, root = desc
        self.codec = parse_codec_op(op)  # (op, scale exponent): float16 pieces, folded as psring.compress says
        self.kind, self.op, self.root = kind, (self.codec[0] if self.codec else op), root
        self.dtype = DTYPES[dtype] if dtype is not None else None
        self.n = prod(tuple(shape)) if shape is not None else 0
        itemsize = self.dtype.itemsize if self.dtype is not None else 1
        mine = [(a, b) for s, a, b in plan(kind, self.n, itemsize, shards, seq) if s == shard]
        self.slice = mine[0] if mine else (0, 0)
        self.pieces = pieces(*self.slice, per_piece(itemsize))
        self.conns: dict[int, Connection] = {}
        self.inbox: dict[int, dict[int, np.ndarray]] = {}  # piece -> src -> data (folds), or queued relays
        # piece j (or a relayed piece ("w", src, j) not yet forwarded) -> the workers' shared-memory slots it is in
        self.held: dict[Any, list[tuple[Connection, int]]] = {}
        self.done_pieces = 0
        self.created = time.monotonic()
        self.waiting: list[tuple[int, int, np.ndarray, dict[str, Any]]] = []  # relays held until all joined
        self.total_rows = 0

    @property
    def label(self) -> str:
        return f"{self.kind} #{self.seq}" + (f" of group {self.gid}" if self.gid != "0" else "")

    def senders(self) -> list[int]:
        """Ranks whose pieces this shard still needs."""
        if self.kind in FOLD_KINDS or self.kind in ("all_gather", "gather"):
            return list(range(self.size))
        if self.kind == "broadcast":
            return [self.root]
        if self.kind == "scatter":
            return [self.root]
        return []

    def expected_frames(self, shard: int, shards: int) -> int:
        """Data frames (all senders together) this shard must see before it is finished."""
        if self.kind in FOLD_KINDS:
            return len(self.pieces)  # one fold per piece
        if self.kind in ("all_gather", "gather"):
            return len(self.pieces) * self.size  # every rank's piece is relayed
        if self.kind == "broadcast":
            return len(self.pieces)
        if self.kind == "scatter":
            return sum(1 for r in range(self.size) if r != self.root and r % shards == shard)
        return 0


class Shard:
    """One parameter-server shard (several may share a process and its port)."""

    def __init__(self, index: int, shards: int, job: str) -> None:
        self.index = index
        self.shards = shards
        self.job = job
        self.pending: dict[tuple[str, int], _Pending] = {}
        self.finished: collections.OrderedDict[tuple[str, int], str] = collections.OrderedDict()
        self.by_rank: dict[int, Connection] = {}  # global worker rank -> its connection to this shard
        self.conns: set[Connection] = set()
        self.buffered: dict[Connection, int] = {}
        self.gone: dict[int, str] = {}  # ranks of the main group that left or were lost
        self.gone_at: dict[int, int | None] = {}  # ... and the first main-group seq they did not finish
        self.frames_in = 0
        self.bytes_folded = 0
        self.params: Any = None  # ParamStore, created on first use
        self.idle = asyncio.Event()
        self.idle.set()

    def __repr__(self) -> str:
        return f"Shard({self.index}/{self.shards}, job={self.job})"

    # ---------------------------------------------------------- connections
    def attach(self, conn: Connection) -> None:
        rank = conn.peer.get("rank")
        world = conn.peer.get("world_size")
        if type(rank) is not int or rank < 0 or type(world) is not int or world < 1:
            raise ProtocolError(f"worker hello claims rank {rank!r} of a world of {world!r}")
        # a rank outside its world is no member: it may talk to the shard, but no collective
        # waits for it and its loss is nobody's business; members must agree on the world
        worlds = {c.peer.get("world_size") for r, c in self.by_rank.items() if c.is_open and r < c.peer["world_size"]}
        if rank < world and worlds and world not in worlds:
            raise ProtocolError(
                f"rank {rank} says job {self.job!r} has {world} ranks; the ranks connected to shard "
                f"{self.index} say {sorted(worlds)}"
            )
        old = self.by_rank.get(rank)
        if old is not None and old.is_open and old is not conn:
            raise ProtocolError(f"rank {rank} is already connected to shard {self.index} from {old.peername}")
        self.by_rank[rank] = conn
        self.gone.pop(rank, None)
        self.gone_at.pop(rank, None)
        self.conns.add(conn)
        self.idle.clear()

    def detach(self, conn: Connection, error: PeerLostError | None) -> None:
        self.conns.discard(conn)
        self.buffered.pop(conn, None)
        rank = conn.peer.get("rank")
        attached = type(rank) is int and self.by_rank.get(rank) is conn
        member = attached and rank < conn.peer["world_size"]
        if attached:  # members and strangers alike: nothing keeps a closed connection
            del self.by_rank[rank]
        if not self.conns:
            self.idle.set()
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
                needed = list(self.pending)
            elif not needed:
                return
        self._report_lost(rank, how)
        for key in needed:
            self._finish(key, "lost")

    def _left_before(self, rank: int, seq: int) -> bool:
        """Whether gone rank left before finishing main-group collective seq."""
        at = self.gone_at.get(rank)
        return at is None or seq >= at

    def _report_lost(self, rank: Any, how: str) -> None:
        header = {"kind": "abort", "tag": ("*", -1), "reason": "lost", "lost": rank, "message": how}
        for other in list(self.conns):
            with contextlib.suppress(PsringError):
                other.send_frame(dict(header))

    # ------------------------------------------------------------- frames in
    def buffer_for(self, conn: Connection, header: dict[str, Any]) -> memoryview | None:
        # each piece is read straight into a buffer of its own, recycled once folded and sent
        if header["kind"] == "ps_data" and header["nbytes"] >= POOLED_MIN:
            return memoryview(pooled_bytes(header["nbytes"]))
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
                from .paramserver import handle_param

                handle_param(self, conn, header, payload)
            else:
                raise ProtocolError(f"a {kind!r} frame means nothing to a parameter server")
        except ProtocolError as exc:
            self._reject(conn, str(exc))

    def _reject(self, conn: Connection, message: str) -> None:
        logger.warning("%r: dropping rank %s (%s): %s", self, conn.peer.get("rank"), conn.peername, message)
        with contextlib.suppress(PsringError):
            conn.send_frame({"kind": "reject", "reason": f"server shard {self.index}: {message}"})
        asyncio.get_running_loop().call_later(0.05, conn.abort, ProtocolError(message))

    def _on_join(self, conn: Connection, header: dict[str, Any]) -> None:
        tag, desc, src, size = header.get("tag"), header.get("call"), header.get("src"), header.get("size")
        if not (isinstance(tag, tuple) and len(tag) == 3 and isinstance(tag[0], str) and type(tag[1]) is int):
            raise ProtocolError(f"join frame with a malformed tag {tag!r}")
        if not (type(size) is int and 1 <= size <= 1 << 16 and type(src) is int and 0 <= src < size):
            raise ProtocolError(f"join frame with src={src!r} size={size!r}")
        _check_desc(desc)
        key = (tag[0], tag[1])
        if key in self.finished:
            if self.finished[key] != "done":  # abandoned: tell the latecomer at once
                self._send_abort(conn, key, self.finished[key], f"{desc[0]} #{tag[1]} was abandoned")
            return
        pending = self.pending.get(key)
        if pending is None:
            gone = [r for r in self.gone if r < size and self._left_before(r, key[1])] if key[0] == "0" else []
            if gone:  # it can never complete: say so now rather than at the deadline
                conn.send_frame(
                    {
                        "kind": "abort",
                        "tag": ("*", -1),
                        "reason": "lost",
                        "lost": gone[0],
                        "message": self.gone[gone[0]],
                    }
                )
                return
            pending = _Pending(key[0], key[1], desc, size, src, self.index, self.shards)
            self.pending[key] = pending
        elif desc != pending.desc or size != pending.size:
            if size != pending.size:
                message = (
                    f"rank {src} joined {desc[0]} #{key[1]} in a group of {size}, "
                    f"rank {pending.first} in a group of {pending.size}"
                )
            else:
                message = mismatch_message(key[1], src, desc, pending.first, pending.desc)
            self._abort_all(key, "mismatch", message)
            return
        if src in pending.conns and pending.conns[src] is not conn:
            raise ProtocolError(f"two workers claim rank {src} of group {key[0]}")
        pending.conns[src] = conn
        if len(pending.conns) == pending.size:
            held, pending.waiting = pending.waiting, []
            for src_, j, data, hdr in held:
                if pending.kind == "scatter":
                    self._send_row(pending, src_, data, hdr)
                else:
                    self._account(pending.conns[src_], -data.nbytes)
                    self._forward(pending, src_, j, data, hdr)
                    release_held(pending.held.pop(("w", src_, j), ()))
            self._maybe_finish(pending)

    def _on_data(self, conn: Connection, header: dict[str, Any], payload: Any) -> None:
        tag, src = header["tag"], header.get("src")
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
            self._scatter_row(pending, conn, header, payload)
            return
        if not 0 <= j < len(pending.pieces):
            raise ProtocolError(
                f"piece {j} of {pending.label} is out of range (this shard has {len(pending.pieces)}"
                f" of {PIECE_BYTES} bytes: is PSRING_PS_PIECE the same for workers and servers?)"
            )
        pa, pb = pending.pieces[j]
        assert pending.dtype is not None
        wire_dtype = np.dtype(np.float16) if pending.codec else pending.dtype
        want = (pb - pa) * wire_dtype.itemsize
        if header["nbytes"] != want or header.get("dtype") != dtype_name(wire_dtype):
            raise ProtocolError(
                f"piece {j} of {pending.label} from rank {src} has {header['nbytes']} bytes of "
                f"{header.get('dtype')}, expected {want} bytes of {dtype_name(wire_dtype)}"
                + (
                    " (is PSRING_PS_PIECE the same for workers and servers?)"
                    if header.get("dtype") == dtype_name(wire_dtype)
                    else ""
                )
            )
        data = np.frombuffer(payload, dtype=wire_dtype, count=pb - pa)
        if pending.kind in FOLD_KINDS:
            box = pending.inbox.setdefault(j, {})
            if src in box:
                raise ProtocolError(f"rank {src} pushed piece {j} of {pending.label} twice")
            box[src] = data
            if "pool" in header:  # it stays in the worker's shared memory until folded
                pending.held.setdefault(j, []).append((conn, conn.hold_slot()))
            self._account(conn, data.nbytes)
            if len(box) == pending.size:
                self._fold(pending, j, box)
        else:
            if pending.kind == "broadcast" and src != pending.root:
                raise ProtocolError(f"rank {src} pushed data for a broadcast from rank {pending.root}")
            if len(pending.conns) < pending.size:
                pending.waiting.append((src, j, data, header))
                if "pool" in header:  # it stays in the worker's shared memory until forwarded
                    pending.held.setdefault(("w", src, j), []).append((conn, conn.hold_slot()))
                self._account(conn, data.nbytes)
                return
            self._forward(pending, src, j, data, header)

    # ---------------------------------------------------------------- work
    def _fold(self, pending: _Pending, j: int, box: dict[int, np.ndarray]) -> None:
        pa, pb = pending.pieces[j]
        parts = [box[r] for r in range(pending.size)]
        dtype = np.dtype(np.float16) if pending.codec else pending.dtype
        assert dtype is not None
        targets = [pending.conns[r] for r in _result_ranks(pending, pa, pb)]
        # the result goes into a slot of this process's pool when the workers map it: written once, read by all
        pool = (
            next((c.pool for c in targets if c.peer_maps_pool), None) if (pb - pa) * dtype.itemsize >= SHM_MIN else None
        )
        slot = pool.take() if pool is not None else None
        if slot is not None:
            assert pool is not None
            out = pool.view(slot, (pb - pa) * dtype.itemsize).view(dtype)
        else:
            out = np.empty(pb - pa, dtype) if pending.codec else _piece_empty(pb - pa, dtype)
        if pending.codec:
            fold_fp16(parts, pending.op, pending.codec[1], out, pa, pending.n)
        else:
            canonical_fold(parts, pending.op, out, pa, pending.n)
        del pending.inbox[j]
        release_held(pending.held.pop(j, ()))  # handed back with the result frames below
        for src, conn in pending.conns.items():
            self._account(conn, -box[src].nbytes)
        self.bytes_folded += out.nbytes * pending.size
        header = {"kind": "ps_data", "tag": (pending.gid, pending.seq, "r", self.index, j), "call": pending.desc}
        try:
            for conn in targets:
                if slot is not None:
                    assert pool is not None
                    with contextlib.suppress(PsringError):  # its loss is reported through detach
                        conn.send_slot(header, pool, slot, out)
                else:
                    self._send(conn, header, out)
        finally:
            if slot is not None:
                assert pool is not None
                pool.give_back(slot)
        pending.done_pieces += 1
        self._maybe_finish(pending)

    def _forward(self, pending: _Pending, src: int, j: int, data: np.ndarray, header: dict[str, Any]) -> None:
        out = {"kind": "ps_data", "tag": (pending.gid, pending.seq, "r", self.index, j, src), "call": pending.desc}
        if pending.kind == "gather":
            targets = [pending.root] if src != pending.root else []
        else:
            targets = [r for r in range(pending.size) if r != src]
        send_once([pending.conns[r] for r in targets], out, data, stable="pool" not in header, send=self._send)
        pending.done_pieces += 1
        self._maybe_finish(pending)

    def _scatter_row(self, pending: _Pending, conn: Connection, header: dict[str, Any], payload: Any) -> None:
        row = header["tag"][3]
        src = header.get("src")
        if src != pending.root:
            raise ProtocolError(f"rank {src} sent a scatter row, but the root is rank {pending.root}")
        if not (0 <= row < pending.size and row != pending.root and row % self.shards == self.index):
            raise ProtocolError(f"scatter row {row} does not travel through shard {self.index}")
        if "dtype" not in header:
            raise ProtocolError("scatter row carries no array")
        data = wire.decode_tensor(header, payload)
        fwd = {k: v for k, v in header.items() if k in ("dev",)}
        fwd.update(kind="ps_data", tag=(pending.gid, pending.seq, "row"), call=pending.desc)
        if len(pending.conns) < pending.size:
            pending.waiting.append((row, -1, data, fwd))
            return
        self._send_row(pending, row, data, fwd)

    def _send_row(self, pending: _Pending, row: int, data: np.ndarray, fwd: dict[str, Any]) -> None:
        conn = pending.conns[row]
        with contextlib.suppress(PsringError):
            conn.send_tensor(dict(fwd), data)
        pending.done_pieces += 1
        self._maybe_finish(pending)

    def _send(self, conn: Connection, header: dict[str, Any], data: np.ndarray) -> None:
        try:
            conn.send_tensor(dict(header), data)
        except PsringError:
            return  # its loss is reported through detach
        transport = conn.transport
        if transport is not None and transport.get_write_buffer_size() > MAX_BACKLOG:
            conn.abort(PeerLostError(f"rank {conn.peer.get('rank')} stopped reading ({MAX_BACKLOG} bytes unsent)"))

    def _account(self, conn: Connection, nbytes: int) -> None:
        """Track a worker's pushed-but-unreduced bytes; pause reading from it past MAX_BUFFERED."""
        total = self.buffered.get(conn, 0) + nbytes
        self.buffered[conn] = total
        transport = conn.transport
        if transport is None or transport.is_closing():
            return
        if nbytes > 0 and total > MAX_BUFFERED:
            transport.pause_reading()
        elif nbytes < 0 and total <= MAX_BUFFERED // 2:
            with contextlib.suppress(RuntimeError):
                transport.resume_reading()

    def _maybe_finish(self, pending: _Pending) -> None:
        if len(pending.conns) < pending.size:
            return
        if pending.done_pieces >= pending.expected_frames(self.index, self.shards):
            if pending.kind != "scatter" and not pending.pieces:  # nothing to send: say it is done
                header = {"kind": "ps_data", "tag": (pending.gid, pending.seq, "done"), "call": pending.desc}
                for conn in pending.conns.values():
                    with contextlib.suppress(PsringError):
                        conn.send_frame(dict(header))
            self._finish((pending.gid, pending.seq), "done")

    def _finish(self, key: tuple[str, int], outcome: str) -> None:
        pending = self.pending.pop(key, None)
        if pending is not None:
            for held in pending.held.values():
                release_held(held)
            pending.held.clear()
            for conn in pending.conns.values():
                held = sum(b[r].nbytes for b in pending.inbox.values() for r in b if pending.conns.get(r) is conn)
                if held:
                    self._account(conn, -held)
        self.finished[key] = outcome
        while len(self.finished) > 10_000:
            self.finished.popitem(last=False)

    # ------------------------------------------------------------- aborts
    def _abort_all(self, key: tuple[str, int], reason: str, message: str, missing: list[int] | None = None) -> None:
        header = {"kind": "abort", "tag": key, "reason": reason, "message": message, "missing": missing or []}
        for conn in list(self.conns):
            with contextlib.suppress(PsringError):
                conn.send_frame(dict(header))
        self._finish(key, reason)

    def _send_abort(self, conn: Connection, key: tuple[str, int], reason: str, message: str) -> None:
        with contextlib.suppress(PsringError):
            conn.send_frame({"kind": "abort", "tag": key, "reason": reason, "message": message, "missing": []})

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
        self._send(target, fwd, data)


#: pieces from this size are received into (and folded into) pooled buffers
POOLED_MIN = 1 << 20


def release_held(held: Any) -> None:
    """Hand back the workers' shared-memory slots a piece was held in, (connection, slot) pairs
    (a connection that is gone needs nothing back)."""
    for conn, slot in held:
        if conn.is_open:
            conn.release_slot(slot)


def send_once(
    conns: list[Connection],
    header: dict[str, Any],
    data: np.ndarray,
    *,
    stable: bool,
    send: Callable[[Connection, dict[str, Any], np.ndarray], None] | None = None,
) -> None:
    """data to every conn, copied at most once: into a slot of this process's pool that the
    workers mapping it share; for the others, on their sockets -- data itself if it is
    ``stable`` (unchanged until the sockets are done with it), else one private copy.
    ``send`` sends on a socket (default: send_tensor, a lost worker ignored)."""
    pool = next((c.pool for c in conns if c.peer_maps_pool), None) if data.nbytes >= SHM_MIN else None
    slot = pool.take() if pool is not None else None
    if slot is None or pool is None:
        data = data if stable or not conns else data.copy()
        for conn in conns:
            if send is not None:
                send(conn, header, data)
            else:
                with contextlib.suppress(PsringError):  # a lost worker re-sends after reconnecting
                    conn.send_tensor(dict(header), data)
        return
    shared = pool.view(slot, data.nbytes).view(data.dtype)
    np.copyto(shared, data)
    try:
        for conn in conns:
            with contextlib.suppress(PsringError):  # its loss is reported through detach
                conn.send_slot(header, pool, slot, shared)  # a copy for one that does not map the pool
    finally:
        pool.give_back(slot)


def _piece_empty(count: int, dtype: np.dtype) -> np.ndarray:
    return pooled_bytes(count * dtype.itemsize).view(dtype)


def _check_desc(desc: Any) -> None:
    if not (isinstance(desc, tuple) and len(desc) == 5 and desc[0] in KINDS):
        raise ProtocolError(f"join frame with a malformed call descriptor {desc!r}")
    kind, dtype, shape, op, root = desc
    if dtype is not None and dtype not in DTYPES:
        raise ProtocolError(f"dtype {dtype!r} is not allowed")
    if shape is not None and not (isinstance(shape, tuple) and all(type(s) is int and s >= 0 for s in shape)):
        raise ProtocolError(f"shape {shape!r} is not a tuple of sizes")
    if shape is not None and dtype is not None and prod(shape) * DTYPES[dtype].itemsize > MAX_TENSOR:
        raise ProtocolError(f"a {list(shape)} {dtype} tensor is larger than this server accepts ({MAX_TENSOR} bytes)")
    if kind in FOLD_KINDS and parse_codec_op(op) is not None:
        if kind != "all_reduce" or dtype != "float32":
            raise ProtocolError(f"op {op!r} (compressed) needs a float32 all_reduce, not a {dtype} {kind}")
    elif kind in FOLD_KINDS and op not in ("sum", "avg", "min", "max", "prod"):
        raise ProtocolError(f"op {op!r} is not a reduction")
    if root is not None and type(root) is not int:
        raise ProtocolError(f"root {root!r} is not a rank")


def _result_ranks(pending: _Pending, pa: int, pb: int) -> list[int]:
    if pending.kind == "all_reduce":
        return list(range(pending.size))
    if pending.kind == "reduce":
        return [pending.root]
    # reduce_scatter: the ranks whose ring chunk overlaps the piece
    return [r for r, (a, b) in enumerate(ring_chunk_bounds(pending.n, pending.size)) if a < pb and pa < b and a < b]


# ------------------------------------------------------------------ server
class ShardServer:
    """One process's shards behind one listening port, registered in the store."""

    def __init__(self, shard_ids: list[int], num_shards: int, *, job: str, secret: bytes | None) -> None:
        self.shards = {i: Shard(i, num_shards, job) for i in shard_ids}
        self.num_shards = num_shards
        self.job = job
        self.secret = secret
        self.listener: Listener | None = None
        self.store: Any = None
        self.address = ""
        self.on_stop: Any = None  # parameter mode: the final checkpoint
        self.local: set[Connection] = set()  # shard ends of in-process workers (colocated shards)
        self.pool: ShmPool | None = None  # results for workers on this host (made at the first offer)
        self._pool_failed = False

    @property
    def port(self) -> int:
        return self.listener.port if self.listener is not None else 0

    def _route(self, conn: Connection) -> Shard:
        shard_id = conn.peer.get("shard")
        if conn.peer.get("job") != self.job:
            raise ProtocolError(f"worker of job {conn.peer.get('job')!r} dialed a server of job {self.job!r}")
        if shard_id not in self.shards:
            raise ProtocolError(f"this process hosts shards {sorted(self.shards)}, not {shard_id!r}")
        return self.shards[shard_id]

    def _router_for(self, conn: Connection) -> Any:
        return _ShardRouter(self._route(conn))

    def _accepted(self, conn: Connection) -> None:
        self._route(conn).attach(conn)
        conn.pool_factory = self._pool_for_peers

    def _pool_for_peers(self) -> ShmPool | None:
        """This process's shared-memory pool for results, made when a worker first offers its own."""
        if self.pool is None and not self._pool_failed and SHM_SLOTS > 0:
            try:
                self.pool = ShmPool(SHM_SLOTS, PIECE_BYTES)
            except (OSError, ValueError) as exc:
                self._pool_failed = True
                logger.warning("server shard(s) %s: no shared memory for results (%s)", sorted(self.shards), exc)
        return self.pool

    def attach_local(self, hello: dict[str, Any], name: str) -> Connection:
        """Connect a worker of this very process to shard ``hello["shard"]`` without a socket.

        Returns the worker's end. The frames are the same as over TCP, so the shard cannot tell.
        """
        worker_end, shard_end = local_pair(name, f"server shard {hello.get('shard')}")
        shard_end.peer = dict(hello)
        shard_end.router = self._router_for(shard_end)  # checks job and shard, as for a dial
        self._accepted(shard_end)
        self.local.add(shard_end)
        shard_end._closed.add_done_callback(lambda _f: self.local.discard(shard_end))  # no pool: no socket either
        worker_end.peer = {"role": "server", "shards": [hello.get("shard")], "job": self.job}
        return worker_end

    async def start(self, host: str, port: int, advertise: str) -> ShardServer:
        self.listener = Listener(
            self._accepted,
            secret=self.secret,
            info={"role": "server", "shards": sorted(self.shards), "job": self.job, "host": host_key()},
            router_for=self._router_for,
            name=f"server shard(s) {sorted(self.shards)}",
        )
        await self.listener.start(host, port)
        self.address = f"{advertise}:{self.listener.port}"
        return self

    async def register(self, store: Any) -> None:
        """Publish each shard's address (and the shard count) under the job's prefix."""
        self.store = store
        prefix = f"psring/{self.job}"
        await store.set(f"{prefix}/num_servers", str(self.num_shards).encode())
        for i in self.shards:
            await store.set(f"{prefix}/server/{i}", self.address.encode())

    async def drain(self, timeout: float) -> None:
        """Wait (up to timeout) until every worker has disconnected."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(s.idle.wait() for s in self.shards.values())), timeout)

    async def close(self) -> None:
        if self.listener is not None:
            for conn in list(self.listener.connections):
                with contextlib.suppress(Exception):
                    await conn.close()
            await self.listener.close()
            self.listener = None
        for conn in list(self.local):
            conn.abort(PeerLostError("server shut down"))
        if self.pool is not None:
            self.pool.close()
        if self.store is not None:
            with contextlib.suppress(Exception):
                await self.store.close()
            self.store = None


class _ShardRouter:
    def __init__(self, shard: Shard) -> None:
        self.shard = shard

    def buffer_for(self, conn: Connection, header: dict[str, Any]) -> memoryview | None:
        return self.shard.buffer_for(conn, header)

    def deliver(self, conn: Connection, header: dict[str, Any], payload: Any) -> None:
        self.shard.deliver(conn, header, payload)

    def connection_lost(self, conn: Connection, error: PeerLostError | None) -> None:
        self.shard.detach(conn, error)


async def start_servers(
    store: Any,
    num_shards: int,
    *,
    job: str = "default",
    secret: bytes | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    advertise: str | None = None,
    shard_ids: list[int] | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 1,
    restore: bool = False,
) -> ShardServer:
    """Start shards (all of them, or shard_ids) in this event loop and register them in store."""
    if num_shards < 1:
        raise ValueError(f"--shards must be at least 1, got {num_shards}")
    ids = list(range(num_shards)) if shard_ids is None else shard_ids
    for i in ids:
        if not 0 <= i < num_shards:
            raise ValueError(f"shard {i} is out of range for {num_shards} shards")
    server = ShardServer(ids, num_shards, job=job, secret=secret)
    if checkpoint_dir is not None or restore:
        from .paramserver import configure_checkpoints

        configure_checkpoints(server, checkpoint_dir, checkpoint_every, restore)
    await server.start(host, port, advertise or ("127.0.0.1" if host in ("127.0.0.1", "0.0.0.0") else host))
    await server.register(store)
    return server


async def serve_forever(server: ShardServer, on_stop: Any = None) -> None:
    """Run until SIGTERM/SIGINT, then (optionally) checkpoint and close."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for hook in (on_stop, server.on_stop):
        if hook is not None:
            hook()
    await server.close()


__all__ = ["Shard", "ShardServer", "byte_view", "plan", "release_held", "send_once", "start_servers"]
