"""The parameter server's frames: every header a worker or a shard sends, made here, and the tags both
sides name a frame by, spelled once.

A header is a msgpack map (psring.core.wire); its ``kind`` says who takes it on the other side:

- ``ps_req`` (worker -> shard): a collective's join: its call, size, piece and the worker's rank;
- ``ps_data``: a collective's pieces -- a worker's push ``(gid, seq, "p", j)``, a shard's result
  ``(gid, seq, "r", shard, j)`` or relayed piece ``(gid, seq, "r", shard, j, src)``, a scatter's row,
  a "nothing to send" ``done``, a point-to-point array ``(gid, "p2p", src, n)``;
- ``ps_param``: parameter mode and sparse tables (SyncSGD over ps), an ``op`` each: worker -> shard
  ``init``, ``init_state``, ``pull``, ``state``, ``push``, ``admit``, ``sp_init``, ``sp_push``, ``sp_pull``,
  ``sp_admit``; shard -> worker ``params``, ``state``, ``result``, ``sp_done``, ``sp_rows``;
- ``abort``: a collective abandoned (mismatch, timeout, a lost worker), either way;
- ``reject``: a shard turns a worker's connection away; ``ps_link``: a link probe (ps.worker.linkprobe).

The shards parse a ``ps_param`` frame with :func:`param_op`.
"""

from __future__ import annotations

from typing import Any

from ...errors import ProtocolError

PARAM = "ps_param"
DATA = "ps_data"
LINK = "ps_link"


# ------------------------------------------------------------------ tags a mailbox waits on
def pull_tag(b: int, shard: int, j: int) -> tuple[Any, ...]:
    """Piece j of bucket b's parameters from ``shard``, answering a pull."""
    return ("param", b, "pull", shard, j)


def pulled_tag(b: int, shard: int) -> tuple[Any, ...]:
    """The end of a shard's answer to a pull of bucket b (its step, its pieces)."""
    return ("param", b, "pulled", shard)


def state_tag(b: int, shard: int, key: str, j: int, req: int) -> tuple[Any, ...]:
    """Piece j of optimizer state ``key`` of bucket b from ``shard``, answering state request ``req``."""
    return ("param", b, "state", shard, key, j, req)


def stated_tag(b: int, shard: int, req: int) -> tuple[Any, ...]:
    """The end of a shard's answer to state request ``req`` (the step, the keys)."""
    return ("param", b, "stated", shard, req)


def result_tag(b: int, t: int, shard: int, j: int) -> tuple[Any, ...]:
    """Piece j of bucket b's parameters after step t, from ``shard``."""
    return ("param", b, t, "r", shard, j)


def sp_done_tag(k: int, shard: int, t: int) -> tuple[Any, ...]:
    """Sparse table k's step t taken on ``shard``."""
    return ("param", k, "sp_done", shard, t)


def sp_rows_tag(k: int, shard: int, req: int) -> tuple[Any, ...]:
    """Rows of sparse table k from ``shard``, answering pull ``req``."""
    return ("param", k, "sp_rows", shard, req)


# ------------------------------------------------------------------ worker -> shard: parameter mode
def init(b: int, j: int, **fields: Any) -> dict[str, Any]:
    """Piece j of bucket b's initial parameters (j = -1: a bucket of no pieces), from rank 0."""
    return {"kind": PARAM, "op": "init", **fields, "tag": ("param", b, "init", j), "piece": None if j < 0 else j}


def init_state(b: int, j: int, key: str) -> dict[str, Any]:
    """Piece j of a resumed run's optimizer state ``key`` of bucket b, from rank 0."""
    return {"kind": PARAM, "op": "init_state", "tag": ("param", b, "init_state", j), "key": key}


def pull(b: int, src: int) -> dict[str, Any]:
    """Ask a shard for its slice of bucket b's parameters."""
    return {"kind": PARAM, "op": "pull", "tag": ("param", b, "pull"), "src": src}


def state_request(b: int, src: int, req: int) -> dict[str, Any]:
    """Ask a shard for its slice of bucket b's optimizer state (``req`` tags the answer)."""
    return {"kind": PARAM, "op": "state", "tag": ("param", b, "state"), "src": src, "req": req}


def push(src: int, codec: str | None = None, resend: bool = False) -> dict[str, Any]:
    """What a step's pushes from ``src`` share (:func:`push_piece` makes each): its codec, and whether they
    are re-sent after a reconnect (a piece applied already is answered, not dropped as late)."""
    header: dict[str, Any] = {"kind": PARAM, "op": "push", "src": src}
    if codec is not None:
        header["codec"] = codec
    if resend:
        header["resend"] = True
    return header


def push_piece(base: dict[str, Any], b: int, t: int, j: int) -> dict[str, Any]:
    """Piece j of bucket b's gradient for step t (``base``: :func:`push`)."""
    return {**base, "tag": ("param", b, t, j)}


def admit(b: int, ranks: list[int], at: int) -> dict[str, Any]:
    """New workers take part in bucket b's steps from step ``at`` (an elastic job's boundary)."""
    return {"kind": PARAM, "op": "admit", "tag": ("param", b, "admit"), "ranks": ranks, "at": at}


def sp_admit(ranks: list[int], at: int) -> dict[str, Any]:
    """New workers take part in every sparse table's steps from step ``at``."""
    return {"kind": PARAM, "op": "sp_admit", "tag": ("param", 0, "sp_admit"), "ranks": ranks, "at": at}


def sp_init(k: int, **fields: Any) -> dict[str, Any]:
    """A run of sparse table k's initial rows (or of its optimizer state ``of``), from rank 0."""
    return {"kind": PARAM, "op": "sp_init", "tag": ("param", k, "sp_init"), "table": k, **fields}


def sp_push(k: int, t: int, src: int, count: int, bad: bool, pull: int | None = None) -> dict[str, Any]:
    """``count`` rows of sparse table k's gradient for step t (``pull``: rows to read back after it)."""
    header = {"kind": PARAM, "op": "sp_push", "tag": ("param", k, "sp_push"), "step": t, "src": src,
              "count": count, "bad": bad}  # fmt: skip
    if pull is not None:
        header["pull"] = pull
    return header


def sp_pull(k: int, req: int, count: int, of: str | None = None) -> dict[str, Any]:
    """Read ``count`` rows of sparse table k (or of its optimizer state ``of``)."""
    header: dict[str, Any] = {"kind": PARAM, "op": "sp_pull", "tag": ("param", k, "sp_pull"), "req": req,
                              "count": count}  # fmt: skip
    if of is not None:
        header["of"] = of
    return header


# ------------------------------------------------------------------ shard -> worker: parameter mode
def params_piece(b: int, shard: int, j: int, step: int) -> dict[str, Any]:
    return {"kind": PARAM, "op": "params", "tag": pull_tag(b, shard, j), "step": step}


def pulled(b: int, shard: int, step: int, pieces: int) -> dict[str, Any]:
    return {"kind": PARAM, "op": "params", "tag": pulled_tag(b, shard), "step": step, "pieces": pieces}


def state_piece(b: int, shard: int, key: str, j: int, req: tuple[int, ...]) -> dict[str, Any]:
    return {"kind": PARAM, "op": "state", "tag": ("param", b, "state", shard, key, j, *req)}


def stated(b: int, shard: int, req: tuple[int, ...], step: int, keys: list[str]) -> dict[str, Any]:
    return {"kind": PARAM, "op": "state", "tag": ("param", b, "stated", shard, *req), "step": step, "keys": keys}


def result(b: int, t: int, shard: int, j: int) -> dict[str, Any]:
    """Piece j of bucket b's parameters after step t (the shard adds ``members``, ``folded`` where they apply)."""
    return {"kind": PARAM, "op": "result", "tag": result_tag(b, t, shard, j), "step": t + 1}


def sp_done(k: int, shard: int, t: int) -> dict[str, Any]:
    return {"kind": PARAM, "op": "sp_done", "tag": sp_done_tag(k, shard, t)}


def sp_rows(k: int, shard: int, req: Any, step: int) -> dict[str, Any]:
    return {"kind": PARAM, "op": "sp_rows", "tag": sp_rows_tag(k, shard, req), "step": step}


def param_op(header: dict[str, Any], what: str = "parameter") -> tuple[Any, int]:
    """A ``ps_param`` frame's op and bucket (or table) number, or ProtocolError naming a malformed tag."""
    tag = header.get("tag")
    if not (isinstance(tag, tuple) and len(tag) >= 2 and tag[0] == "param" and type(tag[1]) is int):
        raise ProtocolError(f"{what} frame with a malformed tag {tag!r}")
    return header.get("op"), tag[1]


# ------------------------------------------------------------------ collectives
def join(gid: str, seq: int, call: tuple[Any, ...], src: int, size: int, piece: int, **fields: Any) -> dict[str, Any]:
    """A worker joins collective seq at a shard: its call, the group's size and the piece the shard splits
    its slice in (``ordered``, ``weights`` where they apply)."""
    return {"kind": "ps_req", "tag": (gid, seq, "join"), "call": call, "src": src, "size": size, "piece": piece,
            **fields}  # fmt: skip


def data_push(gid: str, seq: int, j: int, call: tuple[Any, ...], src: int) -> dict[str, Any]:
    """Piece j of a worker's part of collective seq (or, for a scatter, row j)."""
    return {"kind": DATA, "tag": (gid, seq, "p", j), "call": call, "src": src}


def data_result(gid: str, seq: int, shard: int, j: int, call: tuple[Any, ...]) -> dict[str, Any]:
    """Piece j of collective seq's result from ``shard``."""
    return {"kind": DATA, "tag": (gid, seq, "r", shard, j), "call": call}


def data_relayed(gid: str, seq: int, shard: int, j: int, src: int, call: tuple[Any, ...]) -> dict[str, Any]:
    """Piece j of rank src's part of collective seq, handed on by ``shard`` (an all_gather, a gather)."""
    return {"kind": DATA, "tag": (gid, seq, "r", shard, j, src), "call": call}


def data_done(gid: str, seq: int, call: tuple[Any, ...]) -> dict[str, Any]:
    """Collective seq has nothing (more) to send from this shard."""
    return {"kind": DATA, "tag": (gid, seq, "done"), "call": call}


def p2p(gid: str, src: int, n: int, device: str, to: int) -> dict[str, Any]:
    """The n-th array rank src sends world rank ``to`` in group gid (relayed by a shard)."""
    return {"kind": DATA, "tag": (gid, "p2p", src, n), "dev": device, "to": to}


# ------------------------------------------------------------------ control
def abort(tag: tuple[Any, ...], reason: str, message: str, **fields: Any) -> dict[str, Any]:
    """Collective ``tag`` (gid, seq; ("*", -1): every one) abandoned for ``reason`` (mismatch, timeout, lost)."""
    return {"kind": "abort", "tag": tag, "reason": reason, "message": message, **fields}


def reject(reason: str) -> dict[str, Any]:
    return {"kind": "reject", "reason": reason}


def link(tag: tuple[Any, ...] | None = None, sndbuf: int | None = None) -> dict[str, Any]:
    """A link probe (``tag``: answered with the same frame) or the send buffer the job took (``sndbuf``)."""
    return {"kind": LINK, "tag": tag} if tag is not None else {"kind": LINK, "sndbuf": sndbuf}


__all__ = [
    "DATA",
    "LINK",
    "PARAM",
    "abort",
    "admit",
    "data_done",
    "data_push",
    "data_relayed",
    "data_result",
    "init",
    "init_state",
    "join",
    "link",
    "p2p",
    "param_op",
    "params_piece",
    "pull",
    "pull_tag",
    "pulled",
    "pulled_tag",
    "push",
    "push_piece",
    "reject",
    "result",
    "result_tag",
    "sp_admit",
    "sp_done",
    "sp_done_tag",
    "sp_init",
    "sp_pull",
    "sp_push",
    "sp_rows",
    "sp_rows_tag",
    "state_piece",
    "state_request",
    "state_tag",
    "stated",
    "stated_tag",
]
