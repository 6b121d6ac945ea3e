"""Array helpers: the allowed dtypes, numpy/cupy dispatch, and flat byte views.

This is the only module that imports cupy (lazily); everything above asks it
which array module an array belongs to.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

import numpy as np

from .. import settings

try:  # bfloat16 is optional: present only where ml_dtypes is installed
    import ml_dtypes

    _BFLOAT16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    _BFLOAT16 = None

_DTYPE_NAMES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
)

#: wire name -> numpy dtype, for every dtype a frame may carry
DTYPES: dict[str, np.dtype] = {name: np.dtype(name) for name in _DTYPE_NAMES}
if _BFLOAT16 is not None:
    DTYPES["bfloat16"] = _BFLOAT16


_cupy: Any = None
_cupy_checked = False


def cupy_module() -> Any | None:
    """Return the cupy module if it imports, else None (never raises)."""
    global _cupy, _cupy_checked
    if not _cupy_checked:
        _cupy_checked = True
        try:
            import cupy

            _cupy = cupy
        except Exception:  # ImportError, or a CUDA library that fails to load
            _cupy = None
    return _cupy


def is_cupy(x: Any) -> bool:
    """True for a cupy ndarray (without importing cupy when x is numpy)."""
    return type(x).__module__.startswith("cupy")


def array_module(x: Any) -> Any:
    """numpy or cupy, whichever x belongs to."""
    if isinstance(x, np.ndarray) or np.isscalar(x):
        return np
    if is_cupy(x):
        return cupy_module()
    raise TypeError(f"expected a numpy or cupy array, got {type(x).__name__}")


_NAME_CACHE: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """The wire name of a dtype; TypeError naming it if it is not allowed."""
    try:
        return _NAME_CACHE[dtype]
    except (KeyError, TypeError):
        pass
    name = _dtype_name(dtype)
    if isinstance(dtype, np.dtype):
        _NAME_CACHE[dtype] = name
    return name


def _dtype_name(dtype: Any) -> str:
    dt = np.dtype(dtype)
    if _BFLOAT16 is not None and dt == _BFLOAT16:
        return "bfloat16"
    name = dt.name
    if name not in DTYPES or dt.byteorder == ">":
        allowed = ", ".join(DTYPES)
        raise TypeError(f"dtype {dt} is not supported by psring (allowed: {allowed})")
    return name


def check_array(x: Any, what: str = "x") -> Any:
    """Validate a user array and return it C-contiguous (copying only if it was not)."""
    if isinstance(x, np.ndarray):
        dtype_name(x.dtype)
        return np.ascontiguousarray(x) if not x.flags.c_contiguous else x
    if is_cupy(x):
        dtype_name(x.dtype)
        cp = cupy_module()
        assert cp is not None  # it made x
        return cp.ascontiguousarray(x) if not x.flags.c_contiguous else x
    raise TypeError(f"{what} must be a numpy or cupy array, got {type(x).__name__}")


def byte_view(x: np.ndarray) -> memoryview:
    """A flat, writable-if-possible byte memoryview of a C-contiguous host array (no copy)."""
    if x.ndim:
        try:  # the buffer's own bytes: a third of the time of the reshape and view below (small calls)
            return memoryview(x).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers
        except (TypeError, ValueError):  # a format memoryview does not know (bfloat16, ...)
            pass
    flat = x.reshape(-1)  # (a 0-d array's own memoryview is read-only)
    return memoryview(flat.view(np.uint8))  # type: ignore[arg-type]  # numpy arrays are buffers


#: elements elementwise host work (an optimizer's update, a codec's encode and decode) takes at a time:
#: its intermediates are a block's worth (256 KiB of float32), not a tensor's -- at a local SGD step a
#: model's. Elementwise, so block by block gives the same bits as all at once.
BLOCK = 1 << 16


def blocks(*arrays: Any) -> list[tuple[Any, ...]]:
    """``arrays`` (alike in size: a parameter, its gradient and state) as blocks of :data:`BLOCK` elements:
    views of them flattened, where every one is a C-contiguous numpy array; else the arrays themselves,
    once (cupy: one kernel an operation; other layouts)."""
    n = arrays[0].size
    if n <= BLOCK or not all(type(a) is np.ndarray and a.flags.c_contiguous and a.size == n for a in arrays):
        return [arrays]
    flat = [a.reshape(-1) for a in arrays]
    return [tuple(f[i : i + BLOCK] for f in flat) for i in range(0, n, BLOCK)]


def prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ------------------------------------------------------------------ result buffers
class _BufferPool:
    """Recycles the memory of large results once the caller lets go of them.

    A result is a new array, but a fresh large array costs its page faults on first
    write (a large share of an all_reduce: docs/design.md); training loops reduce
    same-sized tensors over and over. An array from :func:`result_empty` is backed by
    an owner object whose ``__del__`` hands the memory back; a result the caller keeps
    is never reused. Bounded by ``PSRING_BUFFER_POOL`` bytes (default 512 MiB, 0: off).
    """

    MIN_BYTES = 1 << 20

    def __init__(self) -> None:
        self._cap: int | None = None  # resolved on first use: importing psring never reads PSRING_*
        self.free: dict[int, list[np.ndarray]] = {}
        self.held = 0
        self.lock = threading.Lock()

    @property
    def cap(self) -> int:
        if self._cap is None:
            self._cap = settings.current().buffer_pool
        return self._cap

    def take(self, nbytes: int) -> np.ndarray:
        with self.lock:
            stack = self.free.get(nbytes)
            if stack:
                self.held -= nbytes
                return stack.pop()
        return np.empty(nbytes, np.uint8)

    def give(self, mem: np.ndarray) -> None:
        with self.lock:
            if self.held + mem.nbytes > self.cap:
                # make room: drop the oldest buffers kept
                for size in list(self.free):
                    while self.free[size] and self.held + mem.nbytes > self.cap:
                        self.free[size].pop(0)
                        self.held -= size
                if self.held + mem.nbytes > self.cap:
                    return
            self.free.setdefault(mem.nbytes, []).append(mem)
            self.held += mem.nbytes


class _Owner:
    """The base of a pooled result: when the last view of it goes, its memory goes back."""

    __slots__ = ("__array_interface__", "mem")

    def __init__(self, mem: np.ndarray) -> None:
        self.mem = mem
        self.__array_interface__ = mem.__array_interface__

    def __del__(self) -> None:
        try:
            _POOL.give(self.mem)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


_POOL = _BufferPool()

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
#: glibc's largest mmap threshold on 64-bit systems (allocations above it always get fresh pages)
_MMAP_THRESHOLD_MAX = 32 << 20
_kept_memory: int | None = None


def keep_freed_memory(nbytes: int | None = None) -> bool:
    """Have this process's allocator (glibc) keep up to ``nbytes`` of freed heap memory for reuse
    instead of handing it back to the kernel at once (default: PSRING_BUFFER_POOL; 0: leave it).

    For psring's own long-lived processes only (shard servers, the main job's ranks), never a
    user's: it is process-wide. Arrays of a few MiB whose size changes every step (a sparse step's
    rows: no two steps alike, so :func:`pooled_empty` cannot help) are otherwise served from fresh
    pages each time, because glibc trims its heap and maps large blocks anew, and a fresh page costs
    a fault: a large share of a shard's time in a sparse step (docs/performance-history.md, sparse rows).
    Returns whether the setting took (False off glibc or when nbytes is 0)."""
    global _kept_memory
    if nbytes is None:
        nbytes = settings.current().buffer_pool
    if nbytes <= 0 or sys.platform != "linux":
        return False
    if _kept_memory == nbytes:
        return True
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    limit = min(nbytes, (1 << 31) - 1)
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, min(_MMAP_THRESHOLD_MAX, limit)),  # blocks up to 32 MiB from the heap
            (_M_TRIM_THRESHOLD, limit),  # freed memory up to this stays mapped
            (_M_TOP_PAD, min(64 << 20, limit)),  # and the heap grows in steps, not page by page
        )
    )
    if ok:
        _kept_memory = nbytes
    return ok


def pinned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A host array in page-locked memory from cupy's pinned pool (reused once freed)."""
    cp = cupy_module()
    if cp is None:
        raise RuntimeError("pinned host memory needs cupy")
    dtype = np.dtype(dtype)
    count = int(np.prod(shape)) if shape else 1
    mem = cp.cuda.alloc_pinned_memory(max(count * dtype.itemsize, 1))
    return np.frombuffer(mem, dtype=dtype, count=count).reshape(shape)


def is_pinned(a: np.ndarray) -> bool:
    """True for a host array (or a view of one) made by :func:`pinned_empty`."""
    base: Any = a
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):  # np.frombuffer keeps a memoryview of the pinned block
        base = base.obj
    return base is not None and type(base).__name__ == "PinnedMemoryPointer"


def pooled_bytes(nbytes: int, min_bytes: int = _BufferPool.MIN_BYTES) -> np.ndarray:
    """An uninitialized uint8 buffer, from the pool (and back to it once unused) from ``min_bytes``.

    For receive buffers and per-piece outputs that live only as long as one collective: a
    fresh megabyte-sized buffer costs its page faults on every use (docs/design.md). A
    path that takes two or more buffers of a few hundred KiB a call pools those too (``min_bytes``):
    glibc hands their pages back when they are freed together, and maps them anew on the next call."""
    if nbytes < min_bytes or _POOL.cap <= 0:
        return np.empty(nbytes, np.uint8)
    return np.asarray(_Owner(_POOL.take(nbytes)))


def pooled_empty(count: int, dtype: np.dtype, min_bytes: int = _BufferPool.MIN_BYTES) -> np.ndarray:
    """An uninitialized flat array of ``count`` elements: :func:`pooled_bytes` viewed as ``dtype``."""
    return pooled_bytes(count * dtype.itemsize, min_bytes).view(dtype)


def result_empty(like: np.ndarray, min_bytes: int = _BufferPool.MIN_BYTES) -> np.ndarray:
    """An uninitialized array shaped like ``like`` (flat, C order), recycled from ``min_bytes``
    (:func:`pooled_bytes`).

    The result of a pinned (device-staged) input is pinned too, so it goes back to the
    device in one DMA, without a copy into a staging buffer first."""
    nbytes = like.nbytes
    if nbytes >= _BufferPool.MIN_BYTES and is_pinned(like):
        return pinned_empty(like.shape, like.dtype)
    if nbytes < min_bytes or _POOL.cap <= 0:
        return np.empty_like(like)
    mem = _POOL.take(nbytes)
    return np.asarray(_Owner(mem)).view(like.dtype).reshape(like.shape)
