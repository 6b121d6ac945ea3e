"""Moving cupy arrays to and from the host for the wire.

Device memory goes to the socket through host staging buffers; results come back
to the device the input lived on. Import-safe without cupy: nothing here touches
cupy until a cupy array is handed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .arrays import array_module, check_array, cupy_module, is_cupy, is_pinned, pinned_empty


def available() -> bool:
    """True when cupy imports and sees at least one CUDA device."""
    cp = cupy_module()
    if cp is None:
        return False
    try:
        return int(cp.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # any CUDA failure means no usable device
        return False


PINNED_MIN = 1 << 20


def to_host(x: Any) -> np.ndarray:
    """Copy a cupy array to host memory: pinned (pooled) staging for large arrays."""
    out = pinned_empty(x.shape, x.dtype) if x.nbytes >= PINNED_MIN else np.empty(x.shape, dtype=x.dtype)
    x.get(out=out)
    return out


def to_device(y: np.ndarray, xp: Any) -> Any:
    """Copy a host array onto the current device (through pinned staging when large)."""
    if is_pinned(y) and y.flags.c_contiguous:  # a result reduced into pinned memory: one DMA
        out = xp.empty(y.shape, dtype=y.dtype)
        out.set(y)
        return out
    if y.nbytes >= PINNED_MIN and y.flags.c_contiguous:
        staged = pinned_empty(y.shape, y.dtype)
        np.copyto(staged, y)
        out = xp.empty(y.shape, dtype=y.dtype)
        out.set(staged)
        return out
    return xp.asarray(y)


def host_of(x: Any) -> tuple[np.ndarray, Any]:
    """A collective's input on the host: (the host array, the array module its result goes back to).
    A cupy array is staged (TypeError for what psring does not carry, as check_array says)."""
    x = check_array(x)
    if is_cupy(x):
        return to_host(x), array_module(x)
    return x, np


def back_to(y: np.ndarray, xp: Any) -> Any:
    """A result onto the array module its input came from (host_of's second value)."""
    return y if xp is np else to_device(y, xp)


class StagedInput:
    """A cupy array's copy to pinned host memory, issued range by range in the order a
    collective reads them, so the network can start on the first range while the
    others are still crossing the bus (the ring's data plane waits per range).

    The copies run on the caller's current stream, after whatever produced ``x``.
    ``host`` is the flat pinned destination; ``wait(a, b)`` blocks (any thread) until
    elements ``a:b`` are there; ``wait_all()`` before the buffer may be let go.
    """

    def __init__(self, x: Any, order: Sequence[tuple[int, int]]) -> None:
        cp = cupy_module()
        assert cp is not None  # x is a cupy array
        flat = x.reshape(-1)
        self.host = pinned_empty((flat.size,), flat.dtype)
        self.device = x.device
        stream = cp.cuda.get_current_stream()
        ranges = [(a, b) for a, b in order if b > a]
        covered = sorted(ranges)
        end = 0
        for a, b in covered:  # anything the order leaves out goes last
            if a > end:
                ranges.append((end, a))
            end = max(end, b)
        if end < flat.size:
            ranges.append((end, flat.size))
        self.marks: list[tuple[int, int, Any]] = []
        for a, b in ranges:
            flat[a:b].get(stream=stream, out=self.host[a:b])
            ev = cp.cuda.Event(block=True, disable_timing=True)
            ev.record(stream)
            self.marks.append((a, b, ev))

    def wait(self, a: int, b: int) -> None:
        """Block until host[a:b] holds the input (safe from any thread)."""
        last = None
        for lo, hi, ev in self.marks:
            if lo < b and a < hi:
                last = ev  # one stream: a later event completes after every earlier one
        if last is not None:
            with self.device:
                last.synchronize()

    def wait_all(self) -> None:
        if self.marks:
            with self.device:
                self.marks[-1][2].synchronize()
