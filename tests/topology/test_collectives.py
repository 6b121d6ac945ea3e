"""Every collective against numpy ground truth, over dtypes, shapes and world sizes.

Parametrized over the topology fixture, so each topology must pass the same assertions.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import psring
from psring.core.arrays import DTYPES
from psring.core.fold import canonical_fold, ring_chunk_bounds

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]


def inputs(n_ranks: int, shape: tuple[int, ...], dtype: str, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    out = []
    for _ in range(n_ranks):
        if dt.kind == "b":
            a = rng.integers(0, 2, size=shape).astype(bool)
        elif dt.kind in "iu":
            a = rng.integers(0, 5, size=shape).astype(dt)
        else:
            a = (rng.standard_normal(size=shape) * 4).astype(dt)
        out.append(np.array(a, dtype=dt))
    return out


def expected(xs: list[np.ndarray], op: str) -> np.ndarray:
    return canonical_fold([x.reshape(-1) for x in xs], op, np.empty(xs[0].size, xs[0].dtype)).reshape(xs[0].shape)


@pytest.mark.parametrize("n_ranks", [3, 4, 5, 16])
async def test_one_element_folds_in_the_last_chunks_order(n_ranks: int) -> None:
    """A one-element tensor lies in ring chunk N-1: x_N-1 + x_0 + x_1 + ... (the shortcut for 4-byte
    all_reduces against the general path, with values whose sum depends on the order)."""
    rows = np.zeros((n_ranks, 1), np.float32)
    rows[n_ranks - 1], rows[0], rows[1] = 1e8, -1e8, 1.0  # this order: 0 + 1 = 1; the ranks' order: 0
    fast = canonical_fold(rows, "sum", np.empty(1, np.float32))
    general = canonical_fold(rows, "sum", np.empty(1, np.float32), total=1)
    assert fast.tobytes() == general.tobytes() and fast[0] == 1.0, (fast, general)


@pytest.mark.parametrize("n_ranks", [1, 2, 3, 4, 5, 16])
async def test_small_fold_path_gives_the_canonical_bits(n_ranks: int) -> None:
    """The small-message fold (whole rows gathered by a cached index) against the chunk-by-chunk
    definition, given as a list so that it takes the general path."""
    rng = np.random.default_rng(n_ranks)
    for n in (1, 2, 3, n_ranks - 1, n_ranks + 1, 37, 1000):
        if n < 1:
            continue
        for dtype in ("float32", "float16", "float64", "int32", "uint8"):
            dt = DTYPES[dtype]
            rows = (rng.standard_normal((n_ranks, n)) * 1e3).astype(dt)
            if dt.kind == "f":
                rows.flat[::5] = np.nan  # NaN payloads must come out of the same operand order too
            for op in ("sum", "prod", "min", "max") + (("avg",) if dt.kind == "f" else ()):
                with np.errstate(all="ignore"):
                    fast = canonical_fold(rows, op, np.empty(n, dt))
                    slow = canonical_fold(list(rows), op, np.empty(n, dt))
                assert fast.tobytes() == slow.tobytes(), (n, dtype, op)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (5, 3), (100_003,)])
async def test_all_reduce_sum_shapes(make_groups, topology: str, world: int, shape: tuple[int, ...]) -> None:
    groups = await make_groups(world, topology)
    xs = inputs(world, shape, "float32")
    before = [x.copy() for x in xs]
    ys = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, xs, strict=True)))
    ref = expected(xs, "sum")
    np.testing.assert_allclose(ref, np.sum(np.stack(xs), axis=0, dtype=np.float64), rtol=1e-5, atol=1e-5)
    for y, x, b in zip(ys, xs, before, strict=True):
        assert type(y) is np.ndarray and y.dtype == x.dtype and y.shape == x.shape
        assert y.tobytes() == ref.tobytes()  # identical bits on every rank
        assert not np.shares_memory(y, x)
        assert np.array_equal(x, b)  # input untouched


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("op", ["sum", "min", "max", "prod", "avg"])
async def test_all_reduce_every_dtype_and_op(make_groups, topology: str, dtype: str, op: str) -> None:
    if op == "avg" and DTYPES[dtype].kind not in "f" and dtype != "bfloat16":
        groups = await make_groups(2, topology)
        with pytest.raises(TypeError, match=r"^op='avg' needs a floating dtype"):
            await groups[0].all_reduce(np.zeros(3, DTYPES[dtype]), op="avg")
        return
    groups = await make_groups(3, topology)
    xs = inputs(3, (1001,), dtype, seed=7)
    ys = await asyncio.gather(*(g.all_reduce(x, op=op) for g, x in zip(groups, xs, strict=True)))
    ref = expected(xs, op)
    numpy_ref = {
        "sum": lambda s: np.sum(s, axis=0, dtype=s.dtype) if s.dtype != bool else np.any(s, axis=0),
        "prod": lambda s: np.prod(s, axis=0, dtype=s.dtype) if s.dtype != bool else np.all(s, axis=0),
        "min": lambda s: np.min(s, axis=0),
        "max": lambda s: np.max(s, axis=0),
        "avg": lambda s: np.sum(s.astype(np.float64), axis=0) / 3,
    }[op](np.stack(xs))
    got, want = ref.astype(np.float64), np.asarray(numpy_ref, dtype=np.float64)
    if dtype in ("float16", "bfloat16") and op in ("sum", "avg"):
        # numpy may add in another order (pairwise, or through float32): each rounding errs by half an
        # ulp of a partial sum, so the bound scales with the operands, not with the (cancelled) result
        eps = {"float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]
        bound = 2 * eps * np.abs(np.stack(xs).astype(np.float64)).sum(axis=0)
        assert np.all(np.abs(got - want) <= bound), np.abs(got - want).max()
    else:
        tol = 2e-2 if dtype in ("float16", "bfloat16") else 1e-5
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    for y in ys:
        assert y.dtype == xs[0].dtype and y.tobytes() == ref.tobytes()


async def test_large_all_reduce_uses_ring_and_matches(make_groups, topology: str) -> None:
    groups = await make_groups(4, topology)
    xs = inputs(4, (3 << 20,), "float32", seed=3)  # 12 MiB: the pipelined ring path
    ys = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, xs, strict=True)))
    ref = expected(xs, "sum")
    assert all(y.tobytes() == ref.tobytes() for y in ys)


async def test_sixteen_ranks(make_groups, topology: str) -> None:
    groups = await make_groups(16, topology, timeout=60)
    xs = inputs(16, (37,), "int64")
    ys = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, xs, strict=True)))
    assert all(np.array_equal(y, np.sum(xs, axis=0)) for y in ys)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("shape", [(), (0,), (9,), (600_000,)])
async def test_broadcast(make_groups, topology: str, world: int, shape: tuple[int, ...]) -> None:
    groups = await make_groups(world, topology)
    xs = inputs(world, shape, "float64")
    src = world - 1
    ys = await asyncio.gather(*(g.broadcast(x, src=src) for g, x in zip(groups, xs, strict=True)))
    for y in ys:
        assert y.shape == shape and np.array_equal(y, xs[src])


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("shape", [(), (3, 2), (300_001,)])
async def test_all_gather(make_groups, topology: str, world: int, shape: tuple[int, ...]) -> None:
    groups = await make_groups(world, topology)
    xs = inputs(world, shape, "int32")
    outs = await asyncio.gather(*(g.all_gather(x) for g, x in zip(groups, xs, strict=True)))
    for out in outs:
        assert len(out) == world
        for r in range(world):
            assert out[r].shape == shape and np.array_equal(out[r], xs[r])


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("shape", [(6, 4), (7,), (500_001,)])
async def test_reduce_scatter_is_the_all_reduce_slice(make_groups, topology: str, world: int, shape) -> None:
    groups = await make_groups(world, topology)
    xs = inputs(world, shape, "float32", seed=5)
    outs = await asyncio.gather(*(g.reduce_scatter(x) for g, x in zip(groups, xs, strict=True)))
    ref = expected(xs, "sum").reshape(-1)
    bounds = ring_chunk_bounds(ref.size, world)
    for r, out in enumerate(outs):
        a, b = bounds[r]
        assert out.reshape(-1).tobytes() == ref[a:b].tobytes()
        if shape[0] % world == 0:
            assert out.shape == (shape[0] // world, *shape[1:])


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("size", [5, 400_000])
async def test_reduce_gather_scatter(make_groups, topology: str, world: int, size: int) -> None:
    groups = await make_groups(world, topology)
    xs = inputs(world, (size,), "float32", seed=9)
    dst = world - 1
    red = await asyncio.gather(*(g.reduce(x, dst=dst) for g, x in zip(groups, xs, strict=True)))
    assert red[dst].tobytes() == expected(xs, "sum").tobytes()
    assert all(red[r] is None for r in range(world) if r != dst)
    gat = await asyncio.gather(*(g.gather(x, dst=0) for g, x in zip(groups, xs, strict=True)))
    assert all(np.array_equal(gat[0][r], xs[r]) for r in range(world))
    assert all(gat[r] is None for r in range(1, world))
    parts = inputs(world, (size,), "int16", seed=11)
    sc = await asyncio.gather(*(g.scatter(parts if g.rank == 0 else None, src=0) for g in groups))
    assert all(np.array_equal(sc[r], parts[r]) and sc[r].dtype == np.int16 for r in range(world))


async def test_barrier_and_send_recv(make_groups, topology: str) -> None:
    groups = await make_groups(3, topology)
    await asyncio.gather(*(g.barrier() for g in groups))
    a = np.arange(10, dtype=np.uint16).reshape(2, 5)
    b = np.array(2.5)
    # two messages to the same rank arrive in order; recv posted before send works too
    recv_task = asyncio.ensure_future(groups[2].recv(0))
    await groups[0].send(a, 2)
    await groups[0].send(b, 2)
    first = await recv_task
    second = await groups[2].recv(0)
    assert np.array_equal(first, a) and first.dtype == np.uint16 and first.shape == (2, 5)
    assert second.shape == () and second == 2.5
    with pytest.raises(ValueError, match=r"^dst=5 is not a rank of this group \(0\.\.2\)$"):
        await groups[0].send(a, 5)


async def test_bytes_sent_is_bandwidth_optimal(make_groups, topology: str, monkeypatch) -> None:
    """Ring: each rank sends 2(N-1)/N of the tensor. ps: each worker pushes it once and pulls it once."""
    monkeypatch.setenv("PSRING_RING_BOARD", "0")  # the ring's links (a board posts once: test_shmboard.py)
    for world in (2, 3, 4):
        groups = await make_groups(world, topology)
        x = np.ones(4 << 20, np.float32)  # 16 MiB
        before = [g.stats() for g in groups]
        await asyncio.gather(*(g.all_reduce(x) for g in groups))
        sent = [g.stats()["bytes_sent"] - b["bytes_sent"] for g, b in zip(groups, before, strict=True)]
        received = [g.stats()["bytes_received"] - b["bytes_received"] for g, b in zip(groups, before, strict=True)]
        optimal = 2 * (world - 1) / world * x.nbytes if topology == "ring" else x.nbytes
        for s, r in zip(sent, received, strict=True):
            assert optimal <= s <= optimal * 1.01 + (64 << 10), (world, s, optimal)
            assert optimal <= r <= optimal * 1.01 + (64 << 10), (world, r, optimal)


async def test_inputs_are_validated(make_groups, topology: str) -> None:
    groups = await make_groups(2, topology)
    with pytest.raises(TypeError, match=r"^x must be a numpy or cupy array, got list$"):
        await groups[0].all_reduce([1, 2])
    with pytest.raises(TypeError, match=r"dtype complex64 is not supported"):
        await groups[0].all_reduce(np.zeros(2, np.complex64))
    with pytest.raises(ValueError, match=r"^op='mean' is not one of"):
        await groups[0].all_reduce(np.zeros(2), op="mean")
    # the group still works afterwards (nothing was consumed)
    ys = await asyncio.gather(*(g.all_reduce(np.full(3, g.rank + 1.0)) for g in groups))
    assert all(np.array_equal(y, np.full(3, 3.0)) for y in ys)


async def test_non_contiguous_input(make_groups, topology: str) -> None:
    groups = await make_groups(2, topology)
    base = np.arange(20, dtype=np.float64).reshape(4, 5)
    ys = await asyncio.gather(*(g.all_reduce(base[:, ::2]) for g in groups))
    assert all(np.array_equal(y, 2 * base[:, ::2]) for y in ys)


async def test_subgroup_interleaves_with_parent(make_groups, topology: str) -> None:
    groups = await make_groups(4, topology)
    subs = await asyncio.gather(*(g.new_group([0, 2]) for g in groups))
    assert subs[0].rank == 0 and subs[2].rank == 1 and subs[0].world_size == 2

    async def step(r: int) -> tuple[np.ndarray, np.ndarray | None]:
        sub_result = None
        if r in (0, 2):
            sub_task = asyncio.ensure_future(subs[r].all_reduce(np.full(4, float(r))))
        full = await groups[r].all_reduce(np.full(4, 1.0))
        if r in (0, 2):
            sub_result = await sub_task
        return full, sub_result

    results = await asyncio.gather(*(step(r) for r in range(4)))
    assert all(np.array_equal(full, np.full(4, 4.0)) for full, _ in results)
    assert np.array_equal(results[0][1], np.full(4, 2.0)) and np.array_equal(results[2][1], np.full(4, 2.0))
    with pytest.raises(psring.GroupClosedError, match=r"not a member of subgroup"):
        await subs[1].all_reduce(np.zeros(1))


async def test_closed_group_refuses_calls(make_groups, topology: str) -> None:
    groups = await make_groups(1, topology)
    await groups[0].close()
    await groups[0].close()  # idempotent
    with pytest.raises(psring.GroupClosedError, match=r"is closed$"):
        await groups[0].all_reduce(np.zeros(1))


async def test_a_receive_callback_that_raises_fails_its_collective_not_the_link(make_groups, topology: str) -> None:
    """Any exception in a receive callback (a bug, say) fails that one collective on both topologies;
    it must not escape into the link's receive loop, which would treat the peer as broken (#35)."""
    groups = await make_groups(2, topology)

    def boom(conn: object, header: dict, payload: object) -> None:
        raise KeyError("nbytes")

    for g in groups:
        coll = g.begin("all_reduce", np.ones(4, np.float32), "sum")
        g.guard(coll, boom)(None, {}, None)  # must not raise
        assert isinstance(coll.done.exception(), KeyError)
        g._end(coll, False)
    ys = await asyncio.gather(*(g.all_reduce(np.full(4, g.rank + 1.0, np.float32)) for g in groups))
    assert all(np.array_equal(y, np.full(4, 3.0, np.float32)) for y in ys)
