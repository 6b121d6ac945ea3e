"""Local SGD / DiLoCo for SyncSGD: H steps of an inner optimizer on each rank's own copy, then one
outer step of the averaged pseudo-gradient.

``SyncSGD(..., optimizer=inner, local_steps=H, outer=psring.optim.SGD(lr=0.7, momentum=0.9,
nesterov=True))``: a rank keeps the *global* parameters (the model SyncSGD's placement holds: every
rank's copy over the ring, the shards' over ps) and its *local* ones. Each ``step(grads)`` is an inner
step on the local copy, no communication. Every H steps the pseudo-gradients ``global - local`` are
averaged (with any codec or compressor) and the outer optimizer steps the global parameters -- over
ps on the shards, which hold the outer state, so a worker pushes its pseudo-gradient and pulls the new
global parameters -- and every rank's local copy starts again from them. The ranks' global parameters
are the same bits everywhere and on both topologies (one canonical average, one outer update).

The inner optimizer's state stays on its rank and is kept across outer steps (``reset_inner=True``
starts it afresh at each, which the DiLoCo paper found about as good for Adam-type inner optimizers).
H = 1 with ``outer=SGD(lr=1.0)`` is plain SyncSGD with ``optimizer`` inner SGD, to float rounding.
"""

from __future__ import annotations

from typing import Any

from ..core.arrays import array_module
from ..core.optim import Optimizer


class LocalSteps:
    """A rank's local half of local SGD: its own parameters and inner optimizer state, the count of
    inner steps, and the pseudo-gradient at a boundary."""

    def __init__(self, inner: Optimizer, local_steps: int, reset_inner: bool = False) -> None:
        if type(local_steps) is not int or local_steps < 1:
            raise ValueError(f"local_steps={local_steps!r} must be a positive integer")
        self.inner = inner
        self.every = local_steps
        self.reset_inner = bool(reset_inner)
        self.local: list[Any] = []
        self.state: list[dict[str, Any]] = []
        #: inner steps since the last outer step
        self.since = 0
        #: inner steps in all
        self.inner_steps = 0

    def begin(self, global_flats: list[Any]) -> None:
        """The local copies start from the global parameters (and the inner state afresh)."""
        self.local = [f.copy() for f in global_flats]
        if self.reset_inner or not self.state:
            self.state = [self.inner.init_state(f) for f in self.local]

    def step(self, grads: list[Any]) -> bool:
        """One inner step on the local copies (``grads``: a flat array a bucket, or a bucket's
        ``(offset, flat view)`` pieces: ``LocalModel.pieces``, no copy); whether it ends a round (an
        outer step is due)."""
        for flat, g, st in zip(self.local, grads, self.state, strict=True):
            if not isinstance(g, list):
                self.inner.update(flat, g, st)
                continue
            # piece by piece: the update is elementwise, so the same bits as the bucket at once; every
            # piece sees the step count the bucket had (a scalar of the state), which then moves once
            for off, piece in g:
                part = {k: v[off : off + piece.size] if hasattr(v, "shape") else v for k, v in st.items()}
                self.inner.update(flat[off : off + piece.size], piece, part)
            if g:
                st.update({k: v for k, v in part.items() if not hasattr(v, "shape")})
        self.since += 1
        self.inner_steps += 1
        return self.since >= self.every

    def pseudo(self, global_flats: list[Any]) -> list[Any]:
        """What the ranks average at a boundary: global - local (the outer optimizer's "gradient"),
        made in the local copies' memory (no model's worth more at the outer step: the local copies
        are the new global parameters again once it lands, :meth:`synced`)."""
        for g, loc in zip(global_flats, self.local, strict=True):
            array_module(loc).subtract(g, loc, out=loc)
        return self.local

    def synced(self, global_flats: list[Any]) -> None:
        """An outer step landed: every rank's local copy is the new global parameters again."""
        self.since = 0
        for loc, g in zip(self.local, global_flats, strict=True):
            loc[...] = g
        if self.reset_inner:
            self.state = [self.inner.init_state(f) for f in self.local]

    def config(self) -> dict[str, Any]:
        """What every rank must agree on."""
        return {"local_steps": self.every, "inner": self.inner.config(), "reset_inner": self.reset_inner}


__all__ = ["LocalSteps"]
