"""sparse_all_reduce and SparseRows: every rank's rows summed, unique sorted indices, each index's
rows added in rank order; the same bits on the ring and on ps; bad rows named on every rank, the
group still usable. Real groups in one event loop."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import psring
from psring.core.sparse import merge_rows

pytestmark = pytest.mark.timeout(60)


def _rows(rank: int, count: int = 40, num_rows: int = 30, width: int = 5) -> psring.SparseRows:
    rng = np.random.default_rng(rank)
    idx = rng.integers(0, num_rows, count)  # duplicates within a rank, and across ranks
    return psring.SparseRows(idx, rng.standard_normal((count, width)).astype(np.float32), num_rows)


def _sequential(parts: list[psring.SparseRows]) -> dict[int, np.ndarray]:
    """The rule, one row at a time: rank order, then each rank's own order."""
    out: dict[int, np.ndarray] = {}
    for p in parts:
        for i, v in zip(p.indices.tolist(), p.values, strict=True):
            out[i] = out[i] + v if i in out else v.copy()
    return out


@pytest.mark.asyncio
async def test_rows_are_summed_in_rank_order_the_same_on_both_topologies(make_groups) -> None:
    results = {}
    for topology in ("ring", "ps"):
        groups = await make_groups(3, topology)
        parts = [_rows(g.rank, count=10 * (g.rank + 1)) for g in groups]
        outs = await asyncio.gather(*(g.sparse_all_reduce(p) for g, p in zip(groups, parts, strict=True)))
        want = _sequential(parts)
        for out in outs:
            assert out.indices.tolist() == sorted(want) and out.num_rows == 30 and out.width == 5
            assert all(np.array_equal(out.values[k], want[i]) for k, i in enumerate(out.indices.tolist()))
            assert out.values.dtype == np.float32 and out.indices.dtype == np.int64
        results[topology] = outs[0]
    assert np.array_equal(results["ring"].indices, results["ps"].indices)
    assert np.array_equal(results["ring"].values, results["ps"].values)  # bit for bit


@pytest.mark.asyncio
async def test_a_rank_with_no_rows_and_all_ranks_without(make_groups) -> None:
    groups = await make_groups(2, "ring")
    empty = psring.SparseRows(np.empty(0, np.int64), np.empty((0, 5), np.float32), 30)
    outs = await asyncio.gather(groups[0].sparse_all_reduce(_rows(0)), groups[1].sparse_all_reduce(empty))
    assert np.array_equal(outs[0].values, outs[1].values)
    assert outs[0].indices.tolist() == sorted(set(_rows(0).indices.tolist()))
    none = await asyncio.gather(*(g.sparse_all_reduce(empty) for g in groups))
    assert all(o.indices.size == 0 and o.values.shape == (0, 5) for o in none)


@pytest.mark.asyncio
@pytest.mark.parametrize("topology", ["ring", "ps"])
async def test_bad_rows_are_named_on_every_rank_and_the_group_goes_on(make_groups, topology: str) -> None:
    groups = await make_groups(3, topology)
    out_of_range = psring.SparseRows(np.array([3, 30]), np.ones((2, 5), np.float32), 30)
    res = await asyncio.gather(
        *(g.sparse_all_reduce(out_of_range if g.rank == 1 else _rows(g.rank)) for g in groups), return_exceptions=True
    )
    assert all(isinstance(r, ValueError) and "rank(s) 1 passed an index outside the table's rows" in str(r)
               for r in res), res  # fmt: skip
    assert "index 30 is outside the table's rows 0..29" in str(res[1])
    wide = psring.SparseRows(np.array([1]), np.ones((1, 6), np.float32), 30)
    res = await asyncio.gather(
        *(g.sparse_all_reduce(wide if g.rank == 2 else _rows(g.rank)) for g in groups), return_exceptions=True
    )
    assert all(isinstance(r, psring.MismatchError) and "rank(s) 2 passed rows of another width" in str(r)
               for r in res), res  # fmt: skip
    total = await asyncio.gather(*(g.all_reduce(np.ones(2)) for g in groups))  # still usable
    assert all(float(t[0]) == 3.0 for t in total)


def test_sparse_rows_checks_its_shape_at_once() -> None:
    with pytest.raises(TypeError, match="indices must be a 1-D integer array"):
        psring.SparseRows(np.array([0.5]), np.ones((1, 2)), 4)
    with pytest.raises(ValueError, match=r"values must have shape \(len\(indices\), width\) = \(2, width\)"):
        psring.SparseRows(np.array([0, 1]), np.ones((3, 2)), 4)
    with pytest.raises(ValueError, match="num_rows must be a positive integer"):
        psring.SparseRows(np.array([0]), np.ones((1, 2)), 0)
    rows = psring.SparseRows(np.array([2, 0, 2]), np.arange(6, dtype=np.float32).reshape(3, 2), 4)
    assert rows.problem() is None
    assert rows.to_dense().tolist() == [[2, 3], [0, 0], [4, 6], [0, 0]]
    negative = psring.SparseRows(np.array([-1]), np.ones((1, 2)), 4)
    assert negative.problem() == "index -1 is outside the table's rows 0..3"
    merged = merge_rows([], 4, 2, np.float32)
    assert merged.indices.size == 0 and merged.values.shape == (0, 2)


def test_the_blocking_facade_has_it() -> None:
    assert callable(getattr(psring.BlockingGroup, "sparse_all_reduce", None))


@pytest.mark.asyncio
@pytest.mark.parametrize("topology", ["ring", "ps"])
async def test_a_call_made_while_one_runs_is_numbered_after_it_on_every_rank(make_groups, topology: str) -> None:
    """sparse_all_reduce is three collectives; a call made after it begins takes the number after all
    three on every rank, however far each rank got: here rank 0 calls all_reduce once its sparse call
    has moved on to its later collectives, rank 1 at once (before: a MismatchError, as DDP met it)."""
    groups = await make_groups(2, topology)

    async def calls(g: psring.Group) -> tuple[psring.SparseRows, np.ndarray]:
        sparse = asyncio.ensure_future(g.sparse_all_reduce(_rows(g.rank)))
        await asyncio.sleep(0.2 if g.rank == 0 else 0)  # the sparse call has begun on both
        dense = await g.all_reduce(np.full(3, g.rank + 1.0))
        return await sparse, dense

    outs = await asyncio.gather(*(calls(g) for g in groups))
    want = _sequential([_rows(0), _rows(1)])
    for rows, dense in outs:
        assert rows.indices.tolist() == sorted(want) and dense.tolist() == [3.0, 3.0, 3.0]
        assert all(np.array_equal(rows.values[k], want[i]) for k, i in enumerate(rows.indices.tolist()))


@pytest.mark.parametrize("shards", [1, 2, 3, 7])
def test_a_workers_push_packs_each_shards_rows_in_their_own_order(shards: int) -> None:
    """pack_by_shard (one gather per row) carries what a mask per shard would: the rows of the
    shard's range, in the order the rank had them (the merge adds duplicates in that order)."""
    from psring.topology.ps.rows import pack_by_shard, pack_rows, row_range, unpack_rows

    rng = np.random.default_rng(shards)
    for n in (0, 1, 57, 2000):
        idx = rng.integers(0, 1000, n).astype(np.int64)
        val = rng.standard_normal((n, 5)).astype(np.float32)
        packed = pack_by_shard(idx, val, 1000, shards)
        assert len(packed) == shards
        for s, (count, payload) in enumerate(packed):
            a, b = row_range(1000, shards, s)
            mine = (idx >= a) & (idx < b)
            assert count == int(mine.sum())
            assert payload.tobytes() == pack_rows(idx[mine], val[mine]).tobytes()
            got_idx, got_val, none = unpack_rows(payload, count, 5, np.dtype(np.float32))
            assert np.array_equal(got_idx, idx[mine]) and np.array_equal(got_val, val[mine]) and none.size == 0
        # rows to send back with the step's answer ride after each shard's rows
        pulls = [np.arange(s, s + 3, dtype=np.int64) for s in range(shards)]
        for s, (count, payload) in enumerate(pack_by_shard(idx, val, 1000, shards, pulls)):
            got_idx, got_val, want = unpack_rows(payload, count, 5, np.dtype(np.float32), pull=3)
            assert count == got_idx.size and np.array_equal(want, pulls[s])
