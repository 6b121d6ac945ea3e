"""One shard's slice of one parameter bucket (``Bucket``: its parameters, optimizer state, the pushes
of the step under way) and when a piece has enough pushes to be applied (``enough_pushed``). The
parameter store (``paramstore``) keeps one a bucket; checkpoints (``checkpoint``) write and read them."""

from __future__ import annotations

import json
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np

from ....core.arrays import DTYPES
from ....core.codec import Codec
from ....core.fold import pieces
from ....core.optim import Optimizer
from ....transport.connection import Connection
from ..plan import per_piece, plan


def enough_pushed(pushed: AbstractSet[int], members: set[int], backup: int) -> bool:
    """Whether a piece (or a sparse table's step) can be applied: every member pushed it, or with
    backup workers all but ``backup`` of them (at least one)."""
    return bool(members) and len(members & pushed) >= max(len(members) - backup, 1)


class Bucket:
    """One shard's slice of one parameter bucket, with its optimizer state."""

    def __init__(
        self,
        b: int,
        n: int,
        dtype: str,
        size: int,
        config: dict[str, Any],
        shard: int,
        shards: int,
        piece_bytes: int,
        weights: tuple[int, ...] | None = None,
    ):
        self.b, self.n, self.dtype_name, self.size, self.config = b, n, dtype, size, config
        self.dtype = DTYPES[dtype]
        self.weights = weights  # the shards' shares of the bucket (PSRING_PS_WEIGHTS; None: equal)
        mine = [(a, z) for s, a, z in plan("all_reduce", n, self.dtype.itemsize, shards, b, weights) if s == shard]
        self.slice = mine[0] if mine else (0, 0)
        self.pieces = pieces(*self.slice, per_piece(self.dtype.itemsize, piece_bytes))
        self.param = np.empty(self.slice[1] - self.slice[0], self.dtype)
        self.optimizer = Optimizer.from_config(config)
        self.state: dict[str, Any] = {}
        self.step = 0
        self.ready = False
        self.init_seen: set[int] = set()
        #: optimizer state rank 0 sent with its parameters (a worker-side checkpoint): key -> pieces seen
        self.given_state: dict[str, np.ndarray] = {}
        self.given_seen: set[tuple[str, int]] = set()
        self.given_step: int | None = None
        self.inbox: dict[int, dict[int, np.ndarray]] = {}
        self.slots: dict[int, list[tuple[Connection, int]]] = {}  # piece -> pushes held in workers' shared memory
        #: piece -> the codec and scale of its pushes (None: plain float32)
        self.inbox_scale: dict[int, tuple[Codec, Any] | None] = {}
        self.applied: set[int] = set()  # pieces of the current step already updated
        self.conns: dict[int, Connection] = {}
        self.held: list[tuple[int, list[int] | None]] = []  # results waiting for the checkpoint (piece, folded)
        self.waiting_pulls: list[Connection] = []
        #: elastic (SyncSGD(elastic=True)): a lost worker leaves ``members``; steps go on without it
        self.elastic = False
        self.members: set[int] = set(range(size))
        #: backup workers (SyncSGD(backup=b)): a piece is applied once all but b members pushed it;
        #: later pushes of it are dropped (counted in ``late``)
        self.backup = 0
        self.late = 0
        #: elastic admissions taken: (step, ranks); every live worker sends its word, the first counts
        self.admits: set[tuple[int, tuple[int, ...]]] = set()

    def piece_view(self, j: int) -> tuple[int, int, np.ndarray]:
        pa, pb = self.pieces[j]
        a = self.slice[0]
        return pa, pb, self.param[pa - a : pb - a]

    def start(self) -> None:
        self.state = self.optimizer.init_state(self.param)
        if self.given_step is not None:  # rank 0 resumes from its checkpoint: its state, its step
            for k, v in self.given_state.items():
                self.state[k][...] = v
            self.step = self.state["step"] = self.given_step
        self.ready = True

    def complete(self) -> bool:
        """Every piece of rank 0's initial parameters (and optimizer state, if it sent any) is in."""
        want = len(self.pieces) * len(self.given_state)
        return len(self.init_seen) == len(self.pieces) and len(self.given_seen) == want

    def state_view(self, key: str, j: int) -> np.ndarray:
        pa, pb = self.pieces[j]
        a = self.slice[0]
        return self.state[key][pa - a : pb - a]

    def to_arrays(self, prefix: str) -> dict[str, np.ndarray]:
        meta = {
            "b": self.b,
            "n": self.n,
            "dtype": self.dtype_name,
            "size": self.size,
            "config": self.config,
            "step": self.step,
            "slice": list(self.slice),
            "weights": list(self.weights) if self.weights else None,
        }
        out = {f"{prefix}meta": np.array(json.dumps(meta)), f"{prefix}param": self.param}
        for k, v in Optimizer.state_arrays(self.state).items():
            out[f"{prefix}state.{k}"] = np.asarray(v)
        return out
