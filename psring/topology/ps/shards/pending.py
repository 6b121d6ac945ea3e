"""One collective on one shard (who joined, what arrived, what is left), and a join frame: read, checked,
and told apart from the join that began the collective (``join_mismatch``)."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import numpy as np

from ....core.arrays import DTYPES, prod
from ....core.codec import Codec, parse_descriptor
from ....core.fold import pieces, ring_chunk_bounds
from ....core.reduceop import OPS
from ....errors import ProtocolError
from ....transport.connection import Connection
from ...collective import mismatch_message
from ..plan import FOLD_KINDS, KINDS, check_weights, per_piece, plan

#: the most pieces one collective's slice may have on a shard (the piece size is the workers' word)
MAX_PIECES = 1 << 16


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
        "ordered",
        "piece_bytes",
        "pieces",
        "root",
        "scale",
        "seq",
        "size",
        "slice",
        "total_rows",
        "waiting",
        "weights",
    )

    def __init__(
        self,
        gid: str,
        seq: int,
        desc: tuple[Any, ...],
        size: int,
        first: int,
        shard: int,
        shards: int,
        piece_bytes: int,
        weights: tuple[int, ...] | None = None,
    ):
        self.gid, self.seq, self.desc, self.size, self.first = gid, seq, desc, size, first
        kind, dtype, shape, op, root, _after = desc
        coded = parse_descriptor(op)  # (op, codec, scale exponent): encoded pieces, folded by the codec
        self.codec: Codec | None = coded[1] if coded else None
        self.scale = coded[2] if coded else 0
        self.kind, self.op, self.root = kind, (coded[0] if coded else op), root
        self.dtype = DTYPES[dtype] if dtype is not None else None
        self.n = prod(tuple(shape)) if shape is not None else 0
        itemsize = self.dtype.itemsize if self.dtype is not None else 1
        self.weights = weights  # as the workers' joins said (None: equal slices)
        self.ordered = False  # fold the ranks in rank order (a host-reduce subgroup's: its ranks are hosts)
        mine = [(a, b) for s, a, b in plan(kind, self.n, itemsize, shards, seq, weights) if s == shard]
        self.slice = mine[0] if mine else (0, 0)
        self.piece_bytes = piece_bytes  # as the workers' joins said
        step = per_piece(itemsize, piece_bytes)
        if -(-(self.slice[1] - self.slice[0]) // step) > MAX_PIECES:  # a worker's word: bounded before use
            raise ProtocolError(
                f"{kind} #{seq}: pieces of {piece_bytes} bytes would split this shard's "
                f"{(self.slice[1] - self.slice[0]) * itemsize} bytes into more than {MAX_PIECES}"
            )
        self.pieces = pieces(*self.slice, step)
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


def _check_desc(desc: Any, max_tensor: int) -> None:
    if not (isinstance(desc, tuple) and len(desc) == 6 and desc[0] in KINDS):
        raise ProtocolError(f"join frame with a malformed call descriptor {desc!r}")
    kind, dtype, shape, op, root, after = desc
    if after is not None and type(after) is not int:
        raise ProtocolError(f"after {after!r} is not a call's digest")
    if dtype is not None and dtype not in DTYPES:
        raise ProtocolError(f"dtype {dtype!r} is not allowed")
    if shape is not None and not (isinstance(shape, tuple) and all(type(s) is int and s >= 0 for s in shape)):
        raise ProtocolError(f"shape {shape!r} is not a tuple of sizes")
    if shape is not None and dtype is not None and prod(shape) * DTYPES[dtype].itemsize > max_tensor:
        raise ProtocolError(f"a {list(shape)} {dtype} tensor is larger than this server accepts ({max_tensor} bytes)")
    if kind in FOLD_KINDS and parse_descriptor(op) is not None:
        if kind != "all_reduce" or dtype != "float32":
            raise ProtocolError(f"op {op!r} (compressed) needs a float32 all_reduce, not a {dtype} {kind}")
    elif kind in FOLD_KINDS and op not in OPS:
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


class Join(NamedTuple):
    """A worker's join frame, checked: the collective (``key``: group, seq), its call, the worker's
    place in the group, and how it cuts the call (pieces, the shards' weights, the fold's order)."""

    key: tuple[str, int]
    desc: tuple[Any, ...]
    src: int
    size: int
    piece: int
    weights: tuple[int, ...] | None
    ordered: bool


def weights_in(header: dict[str, Any], shards: int) -> tuple[int, ...] | None:
    """The shard weights a join or parameter init names (None: equal slices), checked."""
    raw = header.get("weights")
    if raw is None:
        return None
    try:
        return check_weights(raw, shards)
    except ValueError as exc:
        raise ProtocolError(f"{header.get('kind')} frame: {exc}") from None


def read_join(header: dict[str, Any], shards: int, piece_default: int, max_frame: int, max_tensor: int) -> Join:
    """A join frame's fields, each checked (a ProtocolError naming the first that is wrong)."""
    tag: Any = header.get("tag")  # wire values, checked below
    desc: Any = header.get("call")
    src: Any = header.get("src")
    size: Any = header.get("size")
    piece: Any = header.get("piece", piece_default)  # a worker that does not say: the setting
    if not (isinstance(tag, tuple) and len(tag) == 3 and isinstance(tag[0], str) and type(tag[1]) is int):
        raise ProtocolError(f"join frame with a malformed tag {tag!r}")
    if not (type(size) is int and 1 <= size <= 1 << 16 and type(src) is int and 0 <= src < size):
        raise ProtocolError(f"join frame with src={src!r} size={size!r}")
    if not (type(piece) is int and 1 <= piece <= max_frame):
        raise ProtocolError(f"join frame with piece={piece!r}")
    _check_desc(desc, max_tensor)
    weights = weights_in(header, shards)
    ordered: Any = header.get("ordered", False)
    if type(ordered) is not bool:
        raise ProtocolError(f"join frame with ordered={ordered!r}")
    return Join((tag[0], tag[1]), desc, src, size, piece, weights, ordered)


def join_mismatch(join: Join, pending: _Pending) -> str | None:
    """What differs between a join and the collective the first worker's join began (None: nothing)."""
    if (join.desc, join.size, join.piece, join.weights, join.ordered) == (
        pending.desc,
        pending.size,
        pending.piece_bytes,
        pending.weights,
        pending.ordered,
    ):
        return None
    (group, seq), src, kind = join.key, join.src, join.desc[0]
    if join.ordered != pending.ordered:
        return (
            f"rank {src} joined {kind} #{seq} of group {group} folding in rank order={join.ordered}, "
            f"rank {pending.first} with {pending.ordered}: a host-reduced all_reduce met a plain one"
        )
    if join.weights != pending.weights:
        return (
            f"rank {src} cuts {kind} #{seq} over the shards by weights {join.weights}, rank {pending.first} "
            f"by {pending.weights}: every worker must take PSRING_PS_WEIGHTS from the same job"
        )
    if join.piece != pending.piece_bytes:
        return (
            f"rank {src} splits {kind} #{seq} into pieces of {join.piece} bytes, rank {pending.first} "
            f"into {pending.piece_bytes}: PSRING_PS_PIECE, PSRING_PS_WIRE_PIECE and PSRING_PS_WIRE_PIECES "
            f"must be the same on every worker"
        )
    if join.size != pending.size:
        return (
            f"rank {src} joined {kind} #{seq} in a group of {join.size}, "
            f"rank {pending.first} in a group of {pending.size}"
        )
    return mismatch_message(seq, src, join.desc, pending.first, pending.desc)
