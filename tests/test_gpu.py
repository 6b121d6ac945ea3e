"""cupy arrays through every collective (runs only where cupy and a CUDA GPU exist)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from psring import gpu
from psring.group import canonical_fold

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.asyncio,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not gpu.available(), reason="needs cupy and a CUDA GPU (none here)"),
]

GPU_DTYPES = ["bool", "int8", "int32", "int64", "uint8", "float16", "float32", "float64"]


def _inputs(cp, world: int, shape: tuple[int, ...], dtype: str):
    rng = np.random.default_rng(1)
    host = [
        (rng.standard_normal(shape) * 3).astype(dtype) if dtype != "bool" else rng.integers(0, 2, shape).astype(bool)
        for _ in range(world)
    ]
    return host, [cp.asarray(h) for h in host]


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (1001,), (1 << 20,)])
async def test_cupy_all_reduce_matches_numpy(make_groups, topology: str, dtype: str, shape) -> None:
    import cupy as cp

    groups = await make_groups(3, topology)
    host, dev = _inputs(cp, 3, shape, dtype)
    ys = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, dev, strict=True)))
    ref = canonical_fold([h.reshape(-1) for h in host], "sum", np.empty(host[0].size, host[0].dtype)).reshape(shape)
    for y in ys:
        assert isinstance(y, cp.ndarray) and y.device == dev[0].device
        assert y.dtype == host[0].dtype and y.shape == shape
        assert cp.asnumpy(y).tobytes() == ref.tobytes()


async def test_cupy_every_collective(make_groups, topology: str) -> None:
    import cupy as cp

    groups = await make_groups(2, topology)
    host, dev = _inputs(cp, 2, (300_001,), "float32")
    b = await asyncio.gather(*(g.broadcast(x, src=1) for g, x in zip(groups, dev, strict=True)))
    assert all(isinstance(y, cp.ndarray) and np.array_equal(cp.asnumpy(y), host[1]) for y in b)
    ag = await asyncio.gather(*(g.all_gather(x) for g, x in zip(groups, dev, strict=True)))
    assert all(isinstance(a[r], cp.ndarray) and np.array_equal(cp.asnumpy(a[r]), host[r]) for a in ag for r in range(2))
    rs = await asyncio.gather(*(g.reduce_scatter(x) for g, x in zip(groups, dev, strict=True)))
    assert all(isinstance(y, cp.ndarray) for y in rs)
    rd = await asyncio.gather(*(g.reduce(x, dst=0) for g, x in zip(groups, dev, strict=True)))
    assert isinstance(rd[0], cp.ndarray) and rd[1] is None
    send = asyncio.ensure_future(groups[0].send(dev[0], 1))
    got = await groups[1].recv(0)
    await send
    assert isinstance(got, cp.ndarray) and np.array_equal(cp.asnumpy(got), host[0])
