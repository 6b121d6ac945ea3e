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


def to_host(x: Any) -> np.ndarray:
    """Copy a cupy array into a new host array (device-to-host, synchronous)."""
    out = np.empty(x.shape, dtype=x.dtype)
    x.get(out=out)
    return out


def to_device(y: np.ndarray, xp: Any) -> Any:
    """Copy a host array onto the current device."""
    return xp.asarray(y)
