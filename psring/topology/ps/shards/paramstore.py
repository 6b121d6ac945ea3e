"""Parameter mode: shards that hold the parameters and the optimizer state.

Parameters travel as *buckets* (flat arrays, each many tensors long; SyncSGD makes
them). Bucket b is split over the shards by the same :func:`psring.topology.ps.plan.plan` as a
collective numbered b, so each shard owns one slice of it. Frames (kind ``ps_param``):

- ``init`` (rank 0, per piece): the starting parameters and the optimizer config. A
  shard that already holds the bucket (restored from a checkpoint) keeps its own.
- ``pull``: the shard answers with its current slice, piece by piece, and the step.
- ``push`` (every worker, per piece, for step t): gradients. Once all N workers pushed
  piece j of step t, the shard averages them in the ring's canonical order, applies the
  optimizer to that piece of the slice, and sends the new parameters to every worker.
  A push for a step already applied (a worker re-sending after a reconnect) is answered
  with the current parameters and never applied twice; duplicates are ignored.

Checkpoints (``--checkpoint-dir``): every K completed steps of a bucket, and on
SIGTERM, each shard writes its buckets (parameters, optimizer state, step) to a
temporary file, fsyncs it and renames it into place. With a checkpoint directory a
step's results are sent only after its checkpoint is on disk (K=1, the default), so a
server SIGKILLed and restarted with ``--restore`` never loses an acknowledged step and
never applies one twice: workers reconnect and re-send, and end with the parameters of
an uninterrupted run. With K>1 a crash rolls a shard back up to K-1 steps; workers
then get an error naming both steps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import numpy as np

from ....core.arrays import DTYPES, dtype_name
from ....core.codec import CODECS, Codec
from ....core.fold import canonical_fold
from ....core.optim import Optimizer
from ....errors import ProtocolError, PsringError
from ....transport.connection import Connection
from .. import frames
from .bucket import Bucket, enough_pushed
from .checkpoint import ShardCheckpoint
from .pending import weights_in
from .relay import release_held, send_once

logger = logging.getLogger(__name__)


class ParamStore:
    """The parameter-mode state of one shard."""

    def __init__(self, shard: Any) -> None:
        self.shard = shard
        self.buckets: dict[int, Bucket] = {}
        #: where and how often its buckets are checkpointed (--checkpoint-dir; off by default)
        self.checkpoint = ShardCheckpoint(shard)
        self.updates_applied = 0
        self.late_pushes = 0  # backup workers: pushes that came after their piece was applied
        self.early_pulls: dict[int, list[Connection]] = {}

    # ------------------------------------------------------------ checkpoints
    def save(self) -> None:
        self.checkpoint.save(self.buckets)

    def restore(self) -> int:
        """Load this shard's checkpoint, if there is one; return the number of buckets restored."""
        restored = self.checkpoint.restore()
        self.buckets.update(restored)
        return len(restored)

    # ----------------------------------------------------------------- frames
    def handle(self, conn: Connection, header: dict[str, Any], payload: Any) -> None:
        op, b = frames.param_op(header)
        if op == "init":
            self._init(conn, b, header, payload)
        elif op == "init_state":
            self._init_state(b, header, payload)
        elif op == "state":
            req = header.get("req")  # echoed in the answer's tags: a retried request gets only its own
            self._send_state(conn, self._bucket(b), (req,) if type(req) is int else ())
        elif op == "pull":
            bucket = self.buckets.get(b)
            if bucket is not None and bucket.ready:
                self._send_params(conn, bucket, "pull")
            else:  # rank 0's init may still be on its way (another connection): answer when it lands
                early = self.early_pulls.setdefault(b, [])
                if len(self.early_pulls) > 100_000 or len(early) > 1 << 16:
                    raise ProtocolError(f"too many pulls of parameter buckets nobody initialised (bucket {b})")
                early.append(conn)
        elif op == "push":
            self._push(conn, b, header, payload)
        elif op == "admit":
            self._admit(b, header)
        else:
            raise ProtocolError(f"parameter frame with unknown op {op!r}")

    def _bucket(self, b: int) -> Bucket:
        bucket = self.buckets.get(b)
        if bucket is None:
            raise ProtocolError(f"unknown parameter bucket {b}: push or pull before rank 0 initialised it")
        return bucket

    def _init(self, conn: Connection, b: int, header: dict[str, Any], payload: Any) -> None:
        n, dtype, size, config, j = (
            header.get("n"),
            header.get("dtype"),
            header.get("size"),
            header.get("optimizer"),
            header.get("piece"),
        )
        if not (type(n) is int and n >= 0 and dtype in DTYPES and type(size) is int and size >= 1):
            raise ProtocolError(f"init of bucket {b} with n={n!r} dtype={dtype!r} size={size!r}")
        weights = weights_in(header, self.shard.shards)
        bucket = self.buckets.get(b)
        if bucket is None:
            try:
                bucket = Bucket(
                    b,
                    n,
                    dtype,
                    size,
                    dict(config or {}),
                    self.shard.index,
                    self.shard.shards,
                    self.shard.settings.ps_piece,
                    weights,
                )
            except (TypeError, ValueError) as exc:
                raise ProtocolError(f"bucket {b}: bad optimizer config {config!r}: {exc}") from None
            bucket.elastic = bool(header.get("elastic"))
            backup = header.get("backup", 0)
            if type(backup) is not int or not 0 <= backup < size:
                raise ProtocolError(f"init of bucket {b} with backup={backup!r}: needs 0 <= backup < {size} workers")
            bucket.backup = backup
            self.buckets[b] = bucket
        elif (bucket.n, bucket.dtype_name, bucket.size) != (n, dtype, size):
            raise ProtocolError(
                f"bucket {b} is {bucket.n} x {bucket.dtype_name} for {bucket.size} workers here, "
                f"init says {n} x {dtype} for {size}"
            )
        elif bucket.weights != weights:
            raise ProtocolError(
                f"bucket {b} is cut over the shards by weights {bucket.weights} here, init says {weights} "
                f"(PSRING_PS_WEIGHTS changed while the shards kept their parameters)"
            )
        if bucket.ready:
            return  # restored or initialised already: the shard's own state wins
        step, keys = header.get("step"), header.get("state_keys")
        if step is not None and bucket.given_step is None:  # a resumed run: its step and optimizer state
            expected = bucket.optimizer.state_keys()  # (not a state of the bucket's size, made to be dropped)
            if type(step) is not int or step < 0 or not isinstance(keys, (list, tuple)) or sorted(keys) != expected:
                raise ProtocolError(
                    f"init of bucket {b} at step {step!r} with optimizer state {keys!r}; this optimizer's state "
                    f"is {expected}"
                )
            bucket.given_step = step
            bucket.given_state = {k: np.empty_like(bucket.param) for k in keys}
        if j is None:  # an empty slice: nothing to fill
            bucket.start()
        else:
            if type(j) is not int or not 0 <= j < len(bucket.pieces):
                raise ProtocolError(f"init piece {j!r} of bucket {b} is out of range")
            pa, pb, view = bucket.piece_view(j)
            if header["nbytes"] != view.nbytes:
                raise ProtocolError(
                    f"init piece {j} of bucket {b} has {header['nbytes']} bytes, expected {view.nbytes}"
                )
            view[...] = np.frombuffer(payload, bucket.dtype, count=pb - pa)
            bucket.init_seen.add(j)
            if bucket.complete():
                bucket.start()
        if bucket.ready:
            pulls, bucket.waiting_pulls = bucket.waiting_pulls + self.early_pulls.pop(b, []), []
            for waiter in pulls:
                if waiter.is_open:
                    self._send_params(waiter, bucket, "pull")

    def _init_state(self, b: int, header: dict[str, Any], payload: Any) -> None:
        """A piece of rank 0's optimizer state, sent after its parameters (a resumed run)."""
        bucket = self._bucket(b)
        if bucket.ready:
            return  # the shard's own state wins, as for the parameters
        key, tag = header.get("key"), header.get("tag")
        j = tag[3] if isinstance(tag, (list, tuple)) and len(tag) == 4 else None
        if key not in bucket.given_state or type(j) is not int or not 0 <= j < len(bucket.pieces):
            raise ProtocolError(f"optimizer state {key!r} piece {j!r} of bucket {b} was not announced")
        pa, pb = bucket.pieces[j]
        a = bucket.slice[0]
        dest = bucket.given_state[key][pa - a : pb - a]
        if header["nbytes"] != dest.nbytes:
            raise ProtocolError(f"optimizer state {key} piece {j} of bucket {b}: {header['nbytes']} bytes")
        dest[...] = np.frombuffer(payload, bucket.dtype, count=pb - pa)
        bucket.given_seen.add((key, j))
        if bucket.complete():
            bucket.start()
            pulls, bucket.waiting_pulls = bucket.waiting_pulls + self.early_pulls.pop(b, []), []
            for waiter in pulls:
                if waiter.is_open:
                    self._send_params(waiter, bucket, "pull")

    def _send_state(self, conn: Connection, bucket: Bucket, req: tuple[int, ...] = ()) -> None:
        """This shard's slice of a bucket's optimizer state, piece by piece, then its step."""
        if not bucket.ready:
            raise ProtocolError(f"optimizer state of bucket {bucket.b} asked for before it was initialised")
        keys = sorted(Optimizer.state_arrays(bucket.state))
        for key in keys:
            for j in range(len(bucket.pieces)):
                header = frames.state_piece(bucket.b, self.shard.index, key, j, req)
                send_once(
                    [conn], header, bucket.state_view(key, j), stable=False, shm_min=self.shard.settings.ps_shm_min
                )
        with contextlib.suppress(PsringError):
            conn.send_frame(frames.stated(bucket.b, self.shard.index, req, bucket.step, keys))

    def _push(self, conn: Connection, b: int, header: dict[str, Any], payload: Any) -> None:
        bucket = self._bucket(b)
        tag, src = header["tag"], header.get("src")
        if len(tag) != 4 or type(tag[2]) is not int or type(tag[3]) is not int or not 0 <= tag[3] < len(bucket.pieces):
            raise ProtocolError(f"push with a malformed tag {tag!r}")
        t, j = tag[2], tag[3]
        if type(src) is not int or not (0 <= src < bucket.size or (bucket.elastic and src in bucket.members)):
            raise ProtocolError(f"push from rank {src!r}, outside 0..{bucket.size - 1}")
        if src not in bucket.members:
            raise ProtocolError(
                f"rank {src} pushed to bucket {b} of an elastic job it left (members now {sorted(bucket.members)})"
            )
        if not bucket.ready:
            raise ProtocolError(f"push to bucket {b} before its initial parameters arrived")
        if t < bucket.step or (t == bucket.step and j in bucket.applied):
            if bucket.backup and not header.get("resend"):
                # a straggler's push, late: the piece was applied without it and its result went to
                # every worker (this one too): drop it, count it
                bucket.late += 1
                self.late_pushes += 1
                return
            # already applied (a re-send after a reconnect): answer, never apply twice
            self._send_result(bucket, t, j, conn)
            return
        if t > bucket.step:
            raise ProtocolError(
                f"rank {src} pushed step {t} of bucket {b}, but this shard is at step {bucket.step} "
                f"(restored from an older checkpoint: steps {bucket.step}..{t - 1} were lost)"
            )
        pa, pb, _view = bucket.piece_view(j)
        coded = self._push_codec(header, b, bucket)  # (codec, scale) of encoded gradients, None: plain
        wire_dtype = coded[0].wire if coded is not None else bucket.dtype
        want = (pb - pa) * wire_dtype.itemsize
        if header["nbytes"] != want or header.get("dtype") != dtype_name(wire_dtype):
            raise ProtocolError(
                f"push piece {j} of bucket {b} from rank {src}: {header['nbytes']} bytes of {header.get('dtype')}, "
                f"expected {want} bytes of {dtype_name(wire_dtype)}"
            )
        bucket.conns[src] = conn
        box = bucket.inbox.setdefault(j, {})
        if src in box:
            return  # a duplicate of a push still waiting for the others
        first = bucket.inbox_scale.setdefault(j, coded)
        if first != coded:
            raise ProtocolError(
                f"rank {src} pushed piece {j} of bucket {b} {_coded_name(coded)}, another rank "
                f"{_coded_name(first)}; every worker must use the same compression"
            )
        box[src] = np.frombuffer(payload, wire_dtype, count=pb - pa)
        if "pool" in header:  # it stays in the worker's shared memory until folded
            bucket.slots.setdefault(j, []).append((conn, conn.hold_slot()))
        if not enough_pushed(box.keys(), bucket.members, bucket.backup):
            return
        self._apply(bucket, t, j)

    @staticmethod
    def _push_codec(header: dict[str, Any], b: int, bucket: Bucket) -> tuple[Codec, Any] | None:
        """The codec and scale a push's gradients travel with (``codec`` and ``scale`` in its header:
        psring.core.codec), None for plain ones; a ProtocolError naming what is wrong."""
        scale = header.get("scale")
        if scale is None:
            return None
        name = header.get("codec")
        if name not in CODECS:
            raise ProtocolError(f"push to bucket {b}: codec {name!r} is not one of {sorted(CODECS)}")
        if bucket.dtype != np.float32:
            raise ProtocolError(f"{name} push to bucket {b} of {bucket.dtype_name}: compression needs float32")
        codec = CODECS[name]
        return codec, codec.read_scale(scale)

    def _apply(self, bucket: Bucket, t: int, j: int) -> None:
        """Every member (with backup workers: all but b of them) pushed piece j of step t: average
        what came in the canonical (rank) order, update, answer."""
        pa, pb, view = bucket.piece_view(j)
        box, coded = bucket.inbox[j], bucket.inbox_scale[j]
        grad = np.empty(pb - pa, bucket.dtype)
        folded = sorted(r for r in box if r in bucket.members)
        parts = [box[r] for r in folded]
        if coded is not None:
            codec, e = coded
            summed = codec.fold(parts, "avg", e, np.empty(pb - pa, codec.wire), pa, bucket.n)
            codec.decode(summed, e, out=grad, offset=pa)
        else:
            hosts = self.shard.layout_of(folded)
            canonical_fold(parts, "avg", grad, offset=pa, total=bucket.n, hosts=hosts)
        del bucket.inbox[j]
        del bucket.inbox_scale[j]
        release_held(bucket.slots.pop(j, ()))
        a = bucket.slice[0]
        state = {k: (v[pa - a : pb - a] if isinstance(v, np.ndarray) else v) for k, v in bucket.state.items()}
        state["step"] = bucket.step
        bucket.optimizer.update(view, grad, state)
        self.updates_applied += 1
        bucket.applied.add(j)
        if self.checkpoint.on:
            bucket.held.append((j, folded if bucket.backup else None))
        else:
            self._send_result(bucket, t, j, folded=folded if bucket.backup else None)
        if len(bucket.applied) == len(bucket.pieces):
            self._step_done(bucket, t)

    def _admit(self, b: int, header: dict[str, Any]) -> None:
        """New workers take part from step ``at`` (a loop's boundary). Every live worker sends it
        before its own pushes of that step and the first to come counts (the others say the same),
        so no piece of the step completes without the new workers -- with backup workers too, where
        a piece completes without some of the old ones."""
        bucket = self._bucket(b)
        ranks, at = header.get("ranks"), header.get("at")
        if not bucket.elastic:
            raise ProtocolError(f"admit to bucket {b}, which is not elastic")
        if not (isinstance(ranks, (list, tuple)) and all(type(r) is int and r >= 0 for r in ranks) and type(at) is int):
            raise ProtocolError(f"admit with ranks {ranks!r} at {at!r}")
        word = (at, tuple(sorted(ranks)))
        if word in bucket.admits:
            return  # another worker's word on an admission taken (a joiner lost since stays out)
        if bucket.pieces and (at != bucket.step or bucket.applied):
            raise ProtocolError(f"admit at step {at!r} to bucket {b}, which is at step {bucket.step}")
        bucket.admits.add(word)
        bucket.members.update(ranks)
        logger.info("%r: rank(s) %s join elastic bucket %d at step %d", self.shard, sorted(ranks), b, at)

    def on_worker_lost(self, rank: int, lost: bool = True) -> None:
        """Elastic buckets go on without a lost worker: its pushes of the step in flight are dropped
        (every piece of a step then averages over the same workers) and pieces that the others all
        pushed are applied now."""
        for bucket in self.buckets.values():
            if not (bucket.elastic and rank in bucket.members):
                continue
            bucket.members.discard(rank)
            bucket.conns.pop(rank, None)
            (logger.warning if lost else logger.info)(
                "%r: rank %d %s elastic bucket %d at step %d; %d worker(s) go on (results now depend on "
                "membership)", self.shard, rank, "was lost from" if lost else "left", bucket.b, bucket.step,
                len(bucket.members),
            )  # fmt: skip
            t = bucket.step
            for j in sorted(bucket.inbox):
                box = bucket.inbox[j]
                box.pop(rank, None)
                if enough_pushed(box.keys(), bucket.members, bucket.backup):
                    self._apply(bucket, t, j)

    def _step_done(self, bucket: Bucket, t: int) -> None:
        bucket.step = t + 1
        bucket.state["step"] = bucket.step
        bucket.applied = set()
        if self.checkpoint.on:
            if bucket.step % self.checkpoint.every == 0:
                t0 = time.perf_counter()
                self.save()
                logger.debug("%r checkpoint after step %d in %.1f ms", self.shard, t, (time.perf_counter() - t0) * 1e3)
            held, bucket.held = bucket.held, []
            for j, folded in held:
                self._send_result(bucket, t, j, folded=folded)

    def _send_result(
        self, bucket: Bucket, t: int, j: int, conn: Connection | None = None, folded: list[int] | None = None
    ) -> None:
        """Piece j's parameters after step t, to conn (a re-send) or to every worker (with backup
        workers: the stragglers too, who did not push it; ``folded`` names whose pushes it took)."""
        _pa, _pb, view = bucket.piece_view(j)
        header = frames.result(bucket.b, t, self.shard.index, j)
        if conn is not None:
            conns = [conn]
        elif bucket.backup:
            by_rank = self.shard.by_rank
            conns = [by_rank[r] for r in sorted(bucket.members) if r in by_rank and by_rank[r].is_open]
        else:
            conns = [bucket.conns[r] for r in sorted(bucket.members) if r in bucket.conns]
        if bucket.elastic:
            header["members"] = sorted(bucket.members)
        if folded is not None:
            header["folded"] = folded
        send_once(conns, header, view, stable=False, shm_min=self.shard.settings.ps_shm_min)

    def _send_params(self, conn: Connection, bucket: Bucket, why: str) -> None:
        for j in range(len(bucket.pieces)):
            _pa, _pb, view = bucket.piece_view(j)
            header = frames.params_piece(bucket.b, self.shard.index, j, bucket.step)
            send_once([conn], header, view, stable=False, shm_min=self.shard.settings.ps_shm_min)
        with contextlib.suppress(PsringError):
            conn.send_frame(frames.pulled(bucket.b, self.shard.index, bucket.step, len(bucket.pieces)))


def param_store(shard: Any) -> ParamStore:
    if shard.params is None:
        shard.params = ParamStore(shard)
    return shard.params


def handle_param(shard: Any, conn: Connection, header: dict[str, Any], payload: Any) -> None:
    param_store(shard).handle(conn, header, payload)


def configure_checkpoints(
    server: Any, directory: str | None, every: int, restore: bool, name: str | None = None
) -> None:
    """Checkpoint every shard of a server to ``directory`` every ``every`` steps (files named by
    ``name``, default the job's), restoring from there first when ``restore``."""
    if every < 1:
        raise ValueError(f"--checkpoint-every must be at least 1, got {every}")
    if restore and directory is None:
        raise ValueError("--restore needs --checkpoint-dir")
    if directory is not None:
        os.makedirs(directory, exist_ok=True)
    for shard in server.shards.values():
        store = param_store(shard)
        store.checkpoint.directory = directory
        store.checkpoint.name = name
        store.checkpoint.every = every
        if restore:
            store.restore()

    def save_all() -> None:
        for s in server.shards.values():
            param_store(s).save()

    server.on_stop = save_all


def _coded_name(coded: tuple[Codec, Any] | None) -> str:
    return "uncompressed" if coded is None else f"as {coded[0].name} at scale {coded[1]}"


__all__ = ["ParamStore", "configure_checkpoints", "handle_param"]
