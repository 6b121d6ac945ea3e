"""Sparse tables on the shards (SyncSGD(..., sparse=[name]) over ps): each shard holds a range of
a table's rows and their optimizer state; workers push the rows their batch touched and pull the
rows their next batch needs, and never hold the table.

Rows are sharded by contiguous range (``row_range``): which shard holds a row is one division, a
pull of nearby ids lands on one shard, and a shard's rows are one array. Per step a shard waits
for every worker's push (empty where the worker touched none of its rows), sums each row's
pushes with ``merge_rows`` in rank order -- the bits a ring's ``sparse_all_reduce`` gives --
divides by the number of workers (elastic: those there now, as a parameter bucket does), and runs
the optimizer on the touched rows only: gathered, updated elementwise with the table's global
step, scattered back (lazy state: rows never touched keep zero moments; Adam's bias correction
counts the table's steps, as torch's SparseAdam does).

Knows connections and frames, not models.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import numpy as np

from ....core.arrays import DTYPES
from ....core.optim import Optimizer
from ....core.sparse import merge_rows
from ....errors import ProtocolError, PsringError
from ....transport.connection import Connection
from .. import frames
from ..rows import row_range, unpack_rows
from .bucket import enough_pushed

logger = logging.getLogger(__name__)


class Table:
    """One shard's rows of one sparse table, with their optimizer state."""

    def __init__(
        self, k: int, num_rows: int, width: int, dtype: str, size: int, config: dict[str, Any], rows: tuple[int, int]
    ):
        self.k, self.num_rows, self.width, self.size = k, num_rows, width, size
        self.dtype = DTYPES[dtype]
        self.rows = rows
        self.param = np.empty((rows[1] - rows[0], width), self.dtype)
        self.filled = 0  # rows of rank 0's initial table received
        #: resuming from a checkpoint: the optimizer state's keys that come with the rows, and the step
        self.state_keys: list[str] = []
        self.start_step = 0
        self.loaded: dict[str, np.ndarray] = {}  # key -> this shard's rows of that state, as they arrive
        self.loaded_filled: dict[str, int] = {}
        self.optimizer = Optimizer.from_config(config)
        self.state: dict[str, Any] = {}
        self.step = 0
        self.ready = False
        self.inbox: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # src -> its rows of this step
        self.bad: set[int] = set()  # the ranks that said their rows of this step are not fit to apply
        self.pulls: dict[int, np.ndarray] = {}  # src -> the rows it wants back with this step's answer
        self.conns: dict[int, Connection] = {}
        #: the workers a step waits for and averages over; elastic (SyncSGD(elastic=True)): a lost
        #: worker leaves it, an admitted one joins it at a step boundary, as a parameter bucket's do
        self.members: set[int] = set(range(size))
        self.elastic = False
        #: backup workers (SyncSGD(backup=b)): a step applies once all but b members pushed; later
        #: pushes of it are dropped (counted in ``late``), as a parameter bucket's
        self.backup = 0
        self.late = 0
        self.admits: set[tuple[int, tuple[int, ...]]] = set()  # admissions taken: (step, ranks)
        self.waiting_pulls: list[tuple[Connection, dict[str, Any], Any]] = []


class Tables:
    """The sparse tables of one shard (``shard.tables``)."""

    def __init__(self, shard: Any) -> None:
        self.shard = shard
        self.tables: dict[int, Table] = {}
        self.early: dict[int, list[tuple[Connection, dict[str, Any], Any]]] = {}  # pulls before the table
        self.rows_applied = 0

    def handle(self, conn: Connection, header: dict[str, Any], payload: Any) -> None:
        op, k = frames.param_op(header, "sparse table")
        if op == "sp_init":
            self._init(header, payload)
        elif op == "sp_push":
            self._push(conn, k, header, payload)
        elif op == "sp_pull":
            self._pull(conn, k, header, payload)
        elif op == "sp_admit":
            ranks, at = header.get("ranks"), header.get("at")
            if not (
                isinstance(ranks, (list, tuple)) and all(type(r) is int and r >= 0 for r in ranks) and type(at) is int
            ):
                raise ProtocolError(f"sparse table admit with ranks={ranks!r} at={at!r}")
            self.admit(list(ranks), at)
        else:
            raise ProtocolError(f"sparse table frame with unknown op {op!r}")

    def _table(self, k: int) -> Table:
        table = self.tables.get(k)
        if table is None:
            raise ProtocolError(f"unknown sparse table {k}: push before rank 0 initialised it")
        return table

    def _init(self, header: dict[str, Any], payload: Any) -> None:
        k, num_rows, width, dtype, size = (header.get(f) for f in ("table", "num_rows", "width", "dtype", "size"))
        first, count = header.get("first"), header.get("count")
        step, keys, of = header.get("step", 0), header.get("state_keys") or [], header.get("of")
        if not (type(k) is int and type(num_rows) is int and num_rows >= 1 and type(width) is int and width >= 0
                and dtype in DTYPES and type(size) is int and size >= 1 and type(step) is int and step >= 0
                and isinstance(keys, (list, tuple)) and all(type(x) is str for x in keys)
                and (of is None or of in keys)):  # fmt: skip
            raise ProtocolError(f"sparse table init with {header!r}")
        table = self.tables.get(k)
        if table is None:
            rows = row_range(num_rows, self.shard.shards, self.shard.index)
            try:
                table = Table(k, num_rows, width, dtype, size, dict(header.get("optimizer") or {}), rows)
            except (TypeError, ValueError) as exc:
                raise ProtocolError(f"sparse table {k}: bad optimizer config: {exc}") from None
            missing = [x for x in keys if x not in table.optimizer.state_keys()]
            if missing:
                raise ProtocolError(f"sparse table {k}: init brings optimizer state {missing} the optimizer has not")
            table.state_keys, table.start_step = list(keys), step
            table.elastic = bool(header.get("elastic"))
            table.backup = header.get("backup", 0)
            if type(table.backup) is not int or not 0 <= table.backup < size:
                raise ProtocolError(f"sparse table {k}: init with backup={table.backup!r}, needs 0..{size - 1}")
            self.tables[k] = table
            table.waiting_pulls.extend(self.early.pop(k, []))
        elif (table.num_rows, table.width, str(table.dtype), table.size, table.state_keys, table.start_step) != (
            num_rows, width, dtype, size, list(keys), step
        ):
            raise ProtocolError(
                f"sparse table {k} is {table.num_rows} x {table.width} {table.dtype} from step {table.start_step} "
                f"with state {table.state_keys}, init says otherwise"
            )
        if table.ready:
            return
        a, b = table.rows
        if not (type(first) is int and type(count) is int and a <= first and first + count <= b):
            raise ProtocolError(f"sparse table {k}: init rows {first!r}+{count!r} outside this shard's {a}..{b}")
        want = count * width * table.dtype.itemsize
        if header["nbytes"] != want:
            raise ProtocolError(f"sparse table {k}: init of {count} rows has {header['nbytes']} bytes, expected {want}")
        if of is None:
            into = table.param
        elif of in table.loaded:
            into = table.loaded[of]
        else:  # the first rows of that state: its array, once
            into = table.loaded[of] = np.empty_like(table.param)
        if count:
            into[first - a : first - a + count] = np.frombuffer(payload, table.dtype).reshape(count, width)
        if of is None:
            table.filled += count
        else:
            table.loaded_filled[of] = table.loaded_filled.get(of, 0) + count
        if table.filled >= b - a and all(table.loaded_filled.get(x, 0) >= b - a for x in table.state_keys):
            table.state = table.optimizer.init_state(table.param)
            table.state.update(table.loaded)  # a checkpoint's state (whole: every row came), at its step
            table.loaded, table.step = {}, table.start_step
            table.ready = True
            pulls, table.waiting_pulls = table.waiting_pulls, []
            for conn, hdr, data in pulls:
                if conn.is_open:
                    self._pull(conn, k, hdr, data)

    def _push(self, conn: Connection, k: int, header: dict[str, Any], payload: Any) -> None:
        table = self._table(k)
        t, src, count, pull = header.get("step"), header.get("src"), header.get("count"), header.get("pull", 0)
        if not (
            type(t) is int
            and type(src) is int
            and (0 <= src < table.size or (table.elastic and src in table.members))
            and type(count) is int
            and count >= 0
            and type(pull) is int
            and pull >= 0
        ):
            raise ProtocolError(f"sparse push to table {k} with step={t!r} src={src!r} count={count!r} pull={pull!r}")
        if not table.ready:
            raise ProtocolError(f"sparse push to table {k} before its initial rows arrived")
        if t < table.step and table.backup:
            # a straggler's rows, late: the step was applied without them and its answer went to every
            # worker (this one too): drop them, count them
            table.late += 1
            return
        if t != table.step:
            raise ProtocolError(f"rank {src} pushed step {t} of sparse table {k}, which is at step {table.step}")
        if src in table.inbox:
            raise ProtocolError(f"rank {src} pushed step {t} of sparse table {k} twice")
        if src not in table.members:
            raise ProtocolError(
                f"rank {src} pushed step {t} of sparse table {k} of an elastic job it left "
                f"(members now {sorted(table.members)})"
            )
        idx, val, want = unpack_rows(payload, count, table.width, table.dtype, owned="pool" not in header, pull=pull)
        a, b = table.rows
        if idx.size and (int(idx.min()) < a or int(idx.max()) >= b):
            raise ProtocolError(f"rank {src} pushed rows of sparse table {k} outside this shard's {a}..{b - 1}")
        if want.size and (int(want.min()) < a or int(want.max()) >= b):
            raise ProtocolError(f"rank {src} asked for rows of sparse table {k} outside this shard's {a}..{b - 1}")
        table.inbox[src] = (idx, val)
        if want.size:
            table.pulls[src] = want
        if header.get("bad"):
            table.bad.add(src)
        table.conns[src] = conn
        if enough_pushed(table.inbox.keys(), table.members, table.backup):
            self._apply(table)

    def admit(self, ranks: list[int], at: int) -> None:
        """New workers push every elastic table from step ``at`` (a loop's boundary). Every live worker
        sends it before its own pushes of that step; the first counts (as a parameter bucket's)."""
        word = (at, tuple(sorted(ranks)))
        for table in self.tables.values():
            if not table.elastic or word in table.admits:
                continue
            if table.step != at:
                raise ProtocolError(f"admit at step {at} to sparse table {table.k}, which is at step {table.step}")
            table.admits.add(word)
            table.members.update(ranks)

    def on_worker_lost(self, rank: int) -> None:
        """Elastic tables go on without a lost worker: its rows of the step in flight are dropped and
        the step applies once the others all pushed."""
        for table in self.tables.values():
            if not (table.elastic and rank in table.members):
                continue
            table.members.discard(rank)
            for held in (table.inbox, table.pulls, table.conns):
                held.pop(rank, None)
            table.bad.discard(rank)
            if table.ready and enough_pushed(table.inbox.keys(), table.members, table.backup):
                self._apply(table)

    def _apply(self, table: Table) -> None:
        # the members that pushed (every one, but with backup workers), in rank order: the bits a ring's
        # sparse_all_reduce gives
        members = sorted(r for r in table.inbox if r in table.members)
        parts = [table.inbox[r] for r in members]
        bad, table.inbox, table.bad = sorted(table.bad), {}, set()
        pulls, table.pulls = table.pulls, {}
        t = table.step
        header = frames.sp_done(table.k, self.shard.index, t)
        if bad:  # a rank's rows do not fit the table: nothing applied, the step taken again (every shard alike)
            header["bad"] = bad
            self._reply(table, header)
            return
        merged = merge_rows(parts, table.num_rows, table.width, table.dtype)
        if merged.indices.size:
            local = merged.indices - table.rows[0]
            grad = merged.values  # merge_rows's own array: divided in place into the mean, as a dense avg
            np.divide(grad, table.dtype.type(len(members)), out=grad)
            table.optimizer.update_rows(table.param, table.state, local, grad, t)  # as the ring's SyncSGD
            self.rows_applied += int(local.size)
        table.step = t + 1
        self._reply(table, header, pulls)

    def _reply(self, table: Table, header: dict[str, Any], pulls: dict[int, np.ndarray] | None = None) -> None:
        """sp_done to every worker, with the rows it asked for (taken after the step's update: what a
        pull right after it would read); with backup workers to the late ones too (no rows: they come
        with a push that was taken)."""
        a = table.rows[0]
        conns = self.shard.by_rank if table.backup else table.conns
        for r in sorted(table.members):
            conn = conns.get(r)
            want = pulls.get(r) if pulls else None
            if conn is not None and want is not None:
                with contextlib.suppress(PsringError):
                    conn.send_tensor({**header, "pull": int(want.size)}, np.take(table.param, want - a, axis=0))
            elif conn is not None:
                with contextlib.suppress(PsringError):
                    conn.send_frame(dict(header))

    def _pull(self, conn: Connection, k: int, header: dict[str, Any], payload: Any) -> None:
        table = self.tables.get(k)
        if table is None or not table.ready:  # rank 0's init may still be on its way (another connection)
            if table is None:
                pending = self.early.setdefault(k, [])
                if len(pending) > 1 << 16 or len(self.early) > 1 << 10:
                    raise ProtocolError(f"too many pulls of sparse table {k}, which nobody initialised")
                pending.append(
                    (conn, header, np.array(np.frombuffer(payload, np.uint8)) if payload is not None else None)
                )
            else:
                table.waiting_pulls.append(
                    (conn, header, np.array(np.frombuffer(payload, np.uint8)) if payload is not None else None)
                )
            return
        count, req = header.get("count"), header.get("req")
        if not (type(count) is int and count >= 0 and type(req) is int):
            raise ProtocolError(f"sparse pull of table {k} with count={count!r} req={req!r}")
        raw = np.frombuffer(payload, np.uint8) if count else np.empty(0, np.uint8)
        if raw.size != count * 8:
            raise ProtocolError(f"sparse pull of {count} rows with {raw.size} bytes of indices")
        idx = raw.view(np.int64)
        a, b = table.rows
        if idx.size and (int(idx.min()) < a or int(idx.max()) >= b):
            raise ProtocolError(f"sparse pull of table {k}: rows outside this shard's {a}..{b - 1}")
        of = header.get("of")
        source = table.param if of is None else table.state.get(of) if isinstance(of, str) else None
        if not isinstance(source, np.ndarray) or source.shape != table.param.shape:
            raise ProtocolError(f"sparse pull of table {k}: {of!r} is not the table or its optimizer's state")
        rows = np.take(source, idx - a, axis=0) if idx.size else np.empty((0, table.width), table.dtype)
        reply = frames.sp_rows(k, self.shard.index, req, table.step)
        with contextlib.suppress(PsringError):
            conn.send_tensor(reply, rows)


def tables_of(shard: Any) -> Tables:
    if getattr(shard, "tables", None) is None:
        shard.tables = Tables(shard)
    return shard.tables
