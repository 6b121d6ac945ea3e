"""Optimizers written once as elementwise array code for numpy and cupy alike.

The formulas and defaults are torch.optim.SGD's and torch.optim.Adam/AdamW's. Every
update is elementwise, so applying it to a whole tensor or to any slice of it gives
the same bits: that is what lets parameter-server shards (which hold slices) and ring
ranks (which hold whole tensors) end with identical parameters.

An optimizer object holds only hyperparameters; the state of one parameter (momentum
buffer, Adam moments, step count) is a plain dict made by :meth:`Optimizer.init_state`,
serialisable with :meth:`Optimizer.state_arrays` for checkpoints.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .arrays import array_module, blocks


class Optimizer:
    """Base: ``update(param, grad, state)`` changes param (and state) in place."""

    name = ""

    def config(self) -> dict[str, Any]:
        """Hyperparameters as plain values (they travel to parameter servers)."""
        return {"name": self.name, **self.__dict__}

    @staticmethod
    def from_config(config: dict[str, Any]) -> Optimizer:
        config = dict(config)
        name = config.pop("name", None)
        cls = {"sgd": SGD, "adam": Adam, "adamw": AdamW}.get(name)
        if cls is None:
            raise ValueError(f"unknown optimizer {name!r} (sgd, adam, adamw)")
        return cls(**config)

    def init_state(self, param: Any) -> dict[str, Any]:
        return {"step": 0}

    def update(self, param: Any, grad: Any, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def update_rows(self, table: Any, state: dict[str, Any], rows: Any, grad: Any, step: int) -> None:
        """A sparse step: update only ``rows`` of a 2-D ``table`` (unique) with their ``grad``, at the
        table's ``step``. The rows and their state are gathered, updated by the same elementwise
        ``update`` as any parameter, and scattered back: state is lazy (torch's SparseAdam), a row's
        moments change only in steps that touch it."""
        xp = array_module(table)  # take: the same rows, 3x faster than fancy indexing for numpy
        sub = xp.take(table, rows, axis=0)
        sub_state = {k: (step if k == "step" else xp.take(v, rows, axis=0)) for k, v in state.items()}
        self.update(sub, grad, sub_state)
        table[rows] = sub
        for k, v in self.state_arrays(sub_state).items():
            state[k][rows] = v

    @staticmethod
    def state_arrays(state: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in state.items() if k != "step"}

    def state_keys(self) -> list[str]:
        """The names of the arrays :meth:`init_state` keeps beside a parameter, sorted (none for plain
        SGD; ``momentum_buffer``; Adam's ``exp_avg``, ``exp_avg_sq``): what a checkpoint must carry."""
        return sorted(self.state_arrays(self.init_state(np.zeros(1, np.float32))))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"{type(self).__name__}({args})"


def _check(name: str, value: float, low: float = 0.0) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= low):
        raise ValueError(f"{name}={value!r} must be a finite number >= {low}")
    return float(value)


class SGD(Optimizer):
    """torch.optim.SGD: buf = g at the first step, then momentum*buf + (1-dampening)*g."""

    name = "sgd"

    def __init__(
        self,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        self.lr = _check("lr", lr)
        self.momentum = _check("momentum", momentum)
        self.dampening = _check("dampening", dampening)
        self.weight_decay = _check("weight_decay", weight_decay)
        self.nesterov = bool(nesterov)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov momentum needs momentum > 0 and dampening = 0")

    def init_state(self, param: Any) -> dict[str, Any]:
        state: dict[str, Any] = {"step": 0}
        if self.momentum:
            state["momentum_buffer"] = array_module(param).zeros_like(param)
        return state

    def update(self, param: Any, grad: Any, state: dict[str, Any]) -> None:
        first = state.get("step", 0) == 0
        buf = state.get("momentum_buffer")
        for p, g, *b in blocks(param, grad, *([buf] if self.momentum else [])):
            self._update(p, g, b[0] if b else None, first)
        state["step"] = state.get("step", 0) + 1

    def _update(self, param: Any, grad: Any, buf: Any, first: bool) -> None:
        xp = array_module(param)
        d_p = grad
        if self.weight_decay:
            d_p = d_p + param.dtype.type(self.weight_decay) * param
        if self.momentum:
            mu = param.dtype.type(self.momentum)
            if first:
                buf[...] = d_p  # torch: the buffer starts as the first gradient
            else:
                xp.multiply(buf, mu, out=buf)
                buf += param.dtype.type(1 - self.dampening) * d_p if self.dampening else d_p
            if self.nesterov:  # d_p + mu * buf, in one new array
                nesterov = xp.multiply(buf, mu)
                xp.add(d_p, nesterov, out=nesterov)
                d_p = nesterov
            else:
                d_p = buf
        if d_p is grad or d_p is buf:
            param -= param.dtype.type(self.lr) * d_p
        else:  # a step's own array: scaled in place (the same bits as lr * d_p)
            xp.multiply(d_p, param.dtype.type(self.lr), out=d_p)
            param -= d_p


class Adam(Optimizer):
    """torch.optim.Adam (weight_decay adds wd*param to the gradient) with bias correction."""

    name = "adam"
    decoupled = False

    def __init__(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        self.lr = _check("lr", lr)
        b1, b2 = betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"betas={betas!r} must lie in [0, 1)")
        self.betas = (float(b1), float(b2))
        self.eps = _check("eps", eps)
        self.weight_decay = _check("weight_decay", weight_decay)

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "lr": self.lr,
            "betas": list(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
        }

    def init_state(self, param: Any) -> dict[str, Any]:
        xp = array_module(param)
        return {"step": 0, "exp_avg": xp.zeros_like(param), "exp_avg_sq": xp.zeros_like(param)}

    def update(self, param: Any, grad: Any, state: dict[str, Any]) -> None:
        step = state["step"] = state.get("step", 0) + 1
        for p, g, m, v in blocks(param, grad, state["exp_avg"], state["exp_avg_sq"]):
            self._update(p, g, m, v, step)

    def _update(self, param: Any, grad: Any, m: Any, v: Any, step: int) -> None:
        xp = array_module(param)
        t = param.dtype.type
        b1, b2 = self.betas
        if self.weight_decay:
            if self.decoupled:
                param *= t(1 - self.lr * self.weight_decay)
            else:
                grad = grad + t(self.weight_decay) * param
        # torch: exp_avg.lerp_(grad, 1 - beta1); exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2).
        # One scratch array for every intermediate (a block's worth, not three): the same operations in the
        # same order as m += (grad - m) * (1 - b1); v += grad * grad * (1 - b2);
        # param -= lr / bias1 * (m / (sqrt(v) / bias2_sqrt + eps)), so the same bits.
        tmp = xp.subtract(grad, m)
        xp.multiply(tmp, t(1 - b1), out=tmp)
        m += tmp
        xp.multiply(v, t(b2), out=v)
        xp.multiply(grad, grad, out=tmp)
        xp.multiply(tmp, t(1 - b2), out=tmp)
        v += tmp
        bias1 = 1 - b1**step
        bias2_sqrt = math.sqrt(1 - b2**step)
        xp.sqrt(v, out=tmp)
        xp.divide(tmp, t(bias2_sqrt), out=tmp)
        tmp += t(self.eps)
        xp.divide(m, tmp, out=tmp)
        xp.multiply(tmp, t(self.lr / bias1), out=tmp)
        param -= tmp


class AdamW(Adam):
    """torch.optim.AdamW: decoupled weight decay (param *= 1 - lr*wd), default wd 1e-2."""

    name = "adamw"
    decoupled = True

    def __init__(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        super().__init__(lr, betas, eps, weight_decay)


__all__ = ["SGD", "Adam", "AdamW", "Optimizer"]
