"""The shard's work on a collective's pieces: folding them in the canonical order, forwarding relayed ones,
and pacing the workers (backpressure on pushes, a bound on unread results).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ....core import wire
from ....core.arrays import pooled_empty
from ....core.fold import Layout, canonical_fold
from ....errors import PeerLostError, ProtocolError, PsringError
from ....settings import Settings
from ....transport.connection import Connection
from ....transport.local import LocalConnection
from .. import frames
from .pending import _Pending, _result_ranks
from .relay import release_held, send_once, shared_pool

logger = logging.getLogger(__name__)


class Folding:
    """A shard's work on the pieces of its collectives (held by :class:`~psring.topology.ps.shards.shard.Shard`):
    folds them in the canonical order, forwards relayed ones, paces the workers that push them.

    Built from what it needs of its shard, not the shard: the settings, the shard's index among
    ``shards``, ``layout_of`` (the two-level order's hosts for a fold over some ranks) and ``finish``
    (a collective is done on this shard: it leaves the shard's table)."""

    def __init__(
        self,
        settings: Settings,
        index: int,
        shards: int,
        layout_of: Callable[[Sequence[int]], Layout | None],
        finish: Callable[[tuple[str, int], str], None],
    ) -> None:
        self.settings = settings
        self.index = index
        self.shards = shards
        self._layout_of = layout_of
        self._finish = finish
        #: a worker's pushed-but-unreduced bytes (its reading pauses past PSRING_SERVER_BUFFER)
        self.buffered: dict[Connection, int] = {}
        self._handing: set[asyncio.Task[None]] = set()  # in-place results waiting for their sockets to drain

    # ---------------------------------------------------------------- work
    def fold(self, pending: _Pending, j: int, box: dict[int, np.ndarray]) -> None:
        pa, pb = pending.pieces[j]
        parts = [box[r] for r in range(pending.size)]
        dtype = pending.codec.wire if pending.codec else pending.dtype
        assert dtype is not None
        targets = [pending.conns[r] for r in _result_ranks(pending, pa, pb)]
        # the result goes into a slot of this process's pool when the workers map it: written once, read by all
        pool = shared_pool(targets, (pb - pa) * dtype.itemsize, self.settings.ps_shm_min)
        slot = pool.take() if pool is not None else None
        header = frames.data_result(pending.gid, pending.seq, self.index, j, pending.desc)
        local, out = None, None
        if slot is not None:
            assert pool is not None
            out = pool.view(slot, (pb - pa) * dtype.itemsize).view(dtype)
        elif not pending.codec:
            local, out = _in_place(targets, header, pb - pa, dtype)
        if out is None:
            out = np.empty(pb - pa, dtype) if pending.codec else pooled_empty(pb - pa, dtype)
        if pending.codec:
            pending.codec.fold(parts, pending.op, pending.scale, out, pa, pending.n)
        else:
            hosts: Layout | None = None
            if pending.kind == "all_reduce" and pending.ordered:  # one "host" of them all: rank order
                hosts = (tuple(range(pending.size)),)
            elif pending.kind == "all_reduce" and pending.gid == "0":
                hosts = self._layout_of(range(pending.size))
            canonical_fold(parts, pending.op, out, pa, pending.n, hosts)
        del pending.inbox[j]
        release_held(pending.held.pop(j, ()))  # handed back with the result frames below
        for src, conn in pending.conns.items():
            self.account(conn, -box[src].nbytes)
        others = [c for c in targets if c is not local]
        try:
            for conn in others:
                if slot is not None:
                    assert pool is not None
                    with contextlib.suppress(PsringError):  # its loss is reported through detach
                        conn.shm.send_slot(header, pool, slot, out)
                else:
                    self.send(conn, header, out)
        finally:
            if slot is not None:
                assert pool is not None
                pool.give_back(slot)
        if local is not None:
            self._hand_over_in_place(local, header, out, others)
        pending.done_pieces += 1
        self.maybe_finish(pending)

    def _hand_over_in_place(
        self, local: LocalConnection, header: dict[str, Any], out: np.ndarray, sent: list[Connection]
    ) -> None:
        """Give the in-process worker the piece folded into its result, once the sockets that send
        it to the others no longer read that memory (the worker may hand the result to its caller)."""
        unsent = [c for c in sent if c.transport is not None and c.transport.get_write_buffer_size()]
        if not unsent:
            self.send(local, header, out)
            return

        async def later() -> None:
            for conn in unsent:
                with contextlib.suppress(PsringError):
                    await conn.flush()
            self.send(local, header, out)

        task = asyncio.get_running_loop().create_task(later())
        self._handing.add(task)
        task.add_done_callback(self._handing.discard)

    def forward(self, pending: _Pending, src: int, j: int, data: np.ndarray, header: dict[str, Any]) -> None:
        out = frames.data_relayed(pending.gid, pending.seq, self.index, j, src, pending.desc)
        if pending.kind == "gather":
            targets = [pending.root] if src != pending.root else []
        else:
            targets = [r for r in range(pending.size) if r != src]
        send_once(
            [pending.conns[r] for r in targets],
            out,
            data,
            stable="pool" not in header,
            send=self.send,
            shm_min=self.settings.ps_shm_min,
        )
        pending.done_pieces += 1
        self.maybe_finish(pending)

    def scatter_row(self, pending: _Pending, conn: Connection, header: dict[str, Any], payload: Any) -> None:
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
        self.send_row(pending, row, data, fwd)

    def send_row(self, pending: _Pending, row: int, data: np.ndarray, fwd: dict[str, Any]) -> None:
        conn = pending.conns[row]
        with contextlib.suppress(PsringError):
            conn.send_tensor(dict(fwd), data)
        pending.done_pieces += 1
        self.maybe_finish(pending)

    def send(self, conn: Connection, header: dict[str, Any], data: np.ndarray) -> None:
        try:
            conn.send_tensor(dict(header), data)
        except PsringError:
            return  # its loss is reported through detach
        transport = conn.transport
        if transport is not None and transport.get_write_buffer_size() > self.settings.server_backlog:
            conn.abort(
                PeerLostError(
                    f"rank {conn.peer.get('rank')} stopped reading ({self.settings.server_backlog} bytes unsent)"
                )
            )

    def account(self, conn: Connection, nbytes: int) -> None:
        """Track a worker's pushed-but-unreduced bytes; pause reading from it past PSRING_SERVER_BUFFER."""
        total = self.buffered.get(conn, 0) + nbytes
        self.buffered[conn] = total
        transport = conn.transport
        if transport is None or transport.is_closing():
            return
        if nbytes > 0 and total > self.settings.server_buffer:
            transport.pause_reading()
        elif nbytes < 0 and total <= self.settings.server_buffer // 2:
            with contextlib.suppress(RuntimeError):
                transport.resume_reading()

    def maybe_finish(self, pending: _Pending) -> None:
        if len(pending.conns) < pending.size:
            return
        if pending.done_pieces >= pending.expected_frames(self.index, self.shards):
            if pending.kind != "scatter" and not pending.pieces:  # nothing to send: say it is done
                header = frames.data_done(pending.gid, pending.seq, pending.desc)
                for conn in pending.conns.values():
                    with contextlib.suppress(PsringError):
                        conn.send_frame(dict(header))
            self._finish((pending.gid, pending.seq), "done")


def _in_place(
    targets: list[Connection], header: dict[str, Any], count: int, dtype: np.dtype
) -> tuple[LocalConnection | None, np.ndarray | None]:
    """The worker in this process among the targets, and the result it posted for this piece to fold
    straight into (no copy); (None, None) when there is none of either."""
    local = next((c for c in targets if isinstance(c, LocalConnection)), None)
    dest = local.peer_buffer(header) if local is not None else None
    if local is None or dest is None or len(dest) != count * dtype.itemsize:
        return None, None
    return local, np.frombuffer(dest, dtype)
