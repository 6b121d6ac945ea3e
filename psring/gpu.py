"""Moving cupy arrays to and from the host for the wire.

Device memory goes to the socket through host staging buffers; results come back
to the device the input lived on. Import-safe without cupy: nothing here touches
cupy until a cupy array is handed in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import cupy_module


def available() -> bool:
    """True when cupy imports and sees at least one CUDA device."""
    cp = cupy_module()
    if cp is None:
        return False
    try:
        return int(cp.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


PINNED_MIN = 1 << 20


def pinned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A host array in page-locked memory from cupy's pinned pool (reused once freed)."""
    cp = cupy_module()
    dtype = np.dtype(dtype)
    count = int(np.prod(shape)) if shape else 1
    mem = cp.cuda.alloc_pinned_memory(max(count * dtype.itemsize, 1))
    return np.frombuffer(mem, dtype=dtype, count=count).reshape(shape)


def to_host(x: Any) -> np.ndarray:
    """Copy a cupy array to host memory: pinned (pooled) staging for large arrays."""
    out = pinned_empty(x.shape, x.dtype) if x.nbytes >= PINNED_MIN else np.empty(x.shape, dtype=x.dtype)
    x.get(out=out)
    return out


def to_device(y: np.ndarray, xp: Any) -> Any:
    """Copy a host array onto the current device (through pinned staging when large)."""
    if y.nbytes >= PINNED_MIN and y.flags.c_contiguous:
        staged = pinned_empty(y.shape, y.dtype)
        np.copyto(staged, y)
        out = xp.empty(y.shape, dtype=y.dtype)
        out.set(staged)
        return out
    return xp.asarray(y)
