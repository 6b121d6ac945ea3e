"""cupy arrays through every collective (runs only where cupy and a CUDA GPU exist)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from psring.core import gpu
from psring.core.fold import canonical_fold

from .conftest import run_tree

pytestmark = [
    pytest.mark.slow,
    pytest.mark.gpu,
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


@pytest.mark.asyncio
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


@pytest.mark.asyncio
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


@pytest.mark.asyncio
@pytest.mark.parametrize("overlap", ["0", "1"])
async def test_cupy_large_all_reduce_takes_the_threaded_plane(make_groups, topology: str, overlap, monkeypatch) -> None:
    """16 MiB float32: above the ring's data-plane threshold (8 MiB), so the staged host copy
    goes through the threaded plane on the ring; ps takes its shards. Exact against numpy,
    with and without PSRING_GPU_OVERLAP (the copy off the device overlapping the network)."""
    import cupy as cp

    monkeypatch.setenv("PSRING_GPU_OVERLAP", overlap)

    groups = await make_groups(3, topology)
    host, dev = _inputs(cp, 3, (1 << 22,), "float32")
    before = [g.net.plane.bytes_sent if getattr(g, "net", None) and g.net.plane else 0 for g in groups]  # type: ignore[attr-defined]
    for _ in range(2):  # the second call reuses pooled result and pinned staging buffers
        ys = await asyncio.gather(*(g.all_reduce(x, op="avg") for g, x in zip(groups, dev, strict=True)))
        ref = canonical_fold([h for h in host], "avg", np.empty(host[0].size, np.float32))
        for y in ys:
            assert isinstance(y, cp.ndarray) and y.device == dev[0].device
            assert cp.asnumpy(y).tobytes() == ref.tobytes()
    # produced by kernels on a non-blocking stream just before the call: the staged copies
    # run on the current stream, so they see the finished values, never stale memory
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        made = [cp.asarray(h) * 2 for h in host]  # queued on the stream, not synchronized
        ys = await asyncio.gather(*(g.all_reduce(m) for g, m in zip(groups, made, strict=True)))
    ref = canonical_fold([h * 2 for h in host], "sum", np.empty(host[0].size, np.float32))
    assert all(cp.asnumpy(y).tobytes() == ref.tobytes() for y in ys)
    if topology == "ring":
        after = [g.net.plane.bytes_sent for g in groups]  # type: ignore[attr-defined]
        assert all(a - b >= 3 * 2 * (1 << 24) * 2 // 3 for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_optimizers_on_cupy_match_numpy(name: str) -> None:
    import cupy as cp

    from psring.optim import SGD, Adam, AdamW

    make = {
        "sgd": lambda: SGD(lr=0.05, momentum=0.9, weight_decay=1e-4),
        "adam": lambda: Adam(lr=0.01),
        "adamw": lambda: AdamW(lr=0.01, weight_decay=0.01),
    }[name]
    rng = np.random.default_rng(3)
    p_np = rng.standard_normal(10_001).astype(np.float32)
    p_cp = cp.asarray(p_np)
    opt_np, opt_cp = make(), make()
    s_np, s_cp = opt_np.init_state(p_np), opt_cp.init_state(p_cp)
    for _ in range(50):
        g = rng.standard_normal(p_np.size).astype(np.float32)
        opt_np.update(p_np, g, s_np)
        opt_cp.update(p_cp, cp.asarray(g), s_cp)
    assert isinstance(p_cp, cp.ndarray)
    np.testing.assert_allclose(cp.asnumpy(p_cp), p_np, rtol=1e-5, atol=1e-6)


def _sgd_model(xp):
    rng = np.random.default_rng(0)
    host = {
        "w": rng.standard_normal((300, 100)).astype(np.float32),
        "b": rng.standard_normal(100).astype(np.float32),
    }
    return {k: xp.asarray(v) for k, v in host.items()}


def _sgd_grads(xp, step: int, rank: int):
    rng = np.random.default_rng(1000 * step + rank)
    return {
        "w": xp.asarray(rng.standard_normal((300, 100)).astype(np.float32)),
        "b": xp.asarray(rng.standard_normal(100).astype(np.float32)),
    }


@pytest.mark.asyncio
@pytest.mark.parametrize("opt", ["sgd", "adam"])
async def test_syncsgd_cupy_run_agrees_with_numpy_run(make_groups, topology: str, opt: str) -> None:
    """The same 30 steps with cupy parameters and with numpy ones: cupy ranks agree bit for bit,
    results stay on the device, and the cupy run matches the numpy run to float32 rounding."""
    import cupy as cp

    import psring
    from psring.optim import SGD, Adam

    make = (lambda: SGD(lr=0.05, momentum=0.9)) if opt == "sgd" else (lambda: Adam(lr=0.01))
    runs = {}
    for xp in (np, cp):
        groups = await make_groups(3, topology)
        opts = [psring.SyncSGD(g, _sgd_model(xp), make()) for g in groups]
        outs: list = []
        for t in range(30):
            outs = await asyncio.gather(*(o.step(_sgd_grads(xp, t, g.rank)) for o, g in zip(opts, groups, strict=True)))
        runs[xp.__name__] = outs
    for k in ("w", "b"):
        dev = runs["cupy"]
        assert all(isinstance(o[k], cp.ndarray) for o in dev)
        for r in range(1, 3):
            assert cp.asnumpy(dev[r][k]).tobytes() == cp.asnumpy(dev[0][k]).tobytes()
        np.testing.assert_allclose(cp.asnumpy(dev[0][k]), runs["numpy"][0][k], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(400)
def test_train_device_cuda_learns_on_both_topologies(topology: str) -> None:
    import json
    import sys

    proc = run_tree(
        [
            sys.executable,
            "-m",
            "psring",
            "train",
            "--device",
            "cuda",
            "--topology",
            topology,
            "--workers",
            "2",
            "--epochs",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["test_accuracy"] >= 0.9 and summary["ranks_agree"] is True
    assert summary["history"][-1]["loss"] < summary["history"][0]["loss"]


@pytest.mark.asyncio
async def test_sparse_tables_on_cupy_agree_with_numpy(make_groups) -> None:
    """SyncSGD(sparse=[name]) with cupy parameters and cupy row values: ring and ps end with the same
    table bit for bit, rows come back on the device, and both match the numpy run to float32 rounding."""
    import cupy as cp

    import psring
    from psring.optim import SGD

    rows, width = 50, 4

    def params(xp):  # type: ignore[no-untyped-def]
        rng = np.random.default_rng(7)
        return {"emb": xp.asarray(rng.standard_normal((rows, width)).astype(np.float32)), "w": xp.ones(3, np.float32)}

    def grads(xp, step: int, rank: int):  # type: ignore[no-untyped-def]
        rng = np.random.default_rng(1000 * step + rank)
        idx = rng.integers(0, rows, 6 + rank)
        vals = xp.asarray(rng.standard_normal((idx.size, width)).astype(np.float32))
        return {"emb": psring.SparseRows(xp.asarray(idx), vals, rows), "w": xp.full(3, rank + 1.0, np.float32)}

    tables = {}
    for xp in (np, cp):
        for topology in ("ring", "ps"):
            groups = await make_groups(3, topology)
            opts = [psring.SyncSGD(g, params(xp), SGD(lr=0.1, momentum=0.9), sparse=["emb"]) for g in groups]
            await asyncio.gather(*(o.start() for o in opts))
            for t in range(4):
                await asyncio.gather(*(o.step(grads(xp, t, g.rank)) for o, g in zip(opts, groups, strict=True)))
            pulled = await asyncio.gather(*(o.pull_rows("emb", np.arange(rows)) for o in opts))
            if xp is cp:
                assert all(isinstance(p, cp.ndarray) for p in pulled)
                pulled = [cp.asnumpy(p) for p in pulled]
            assert all(np.array_equal(p, pulled[0]) for p in pulled)
            tables[(xp.__name__, topology)] = pulled[0]
    assert np.array_equal(tables[("cupy", "ring")], tables[("cupy", "ps")])
    np.testing.assert_allclose(tables[("cupy", "ring")], tables[("numpy", "ring")], rtol=1e-5, atol=1e-6)
