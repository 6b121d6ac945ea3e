"""Backup workers (SyncSGD(backup=b) over ps, Chen et al. 2016): a step completes once all but b
workers pushed; a straggler's late pushes are dropped and counted, it gets every result anyway and
skips the steps completed without it; every worker holds the same parameters. Real groups, real
shards, one event loop (the straggler is held back by the test)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import psring
from psring.optim import SGD
from psring.topology.ps.shards.paramstore import param_store

from .test_sgd import _grads, _model, _servers_of

pytestmark = pytest.mark.timeout(60)


def _late_pushes(group) -> int:  # type: ignore[no-untyped-def]
    return sum(param_store(s).late_pushes for s in _servers_of(group))


@pytest.mark.asyncio
async def test_a_straggler_is_left_out_and_skips_ahead_with_the_same_parameters(make_groups) -> None:
    groups = await make_groups(4, "ps")
    opts = [psring.SyncSGD(g, _model(0), SGD(lr=0.1), backup=1) for g in groups]
    await asyncio.gather(*(o.start() for o in opts))
    fast, slow = opts[:3], opts[3]
    for t in range(5):  # ranks 0-2 take five steps; rank 3 does not push at all
        out = await asyncio.gather(*(o.step(_grads(t, g.rank)) for o, g in zip(fast, groups, strict=False)))
        assert all(np.array_equal(out[0][k], o[k]) for o in out for k in out[0])
    # what three of four workers averaged, five times (the canonical order: ranks 0, 1, 2)
    want = {k: v.copy() for k, v in _model(0).items()}
    for t in range(5):
        for k in want:
            avg = (_grads(t, 0)[k] + _grads(t, 1)[k] + _grads(t, 2)[k]) / np.float32(3)
            want[k] = want[k] - np.float32(0.1) * avg
    for k in want:
        np.testing.assert_allclose(fast[0].params[k], want[k], rtol=1e-6, atol=1e-7)
    # the straggler's step 0 comes late: dropped (counted), answered by the results it already has,
    # and it skips steps 1-4 that were completed without it
    late = _late_pushes(groups[0])
    params = await slow.step(_grads(0, 3))
    assert slow.step_count == 5 and slow.skipped == 4
    assert _late_pushes(groups[0]) > late
    assert all(np.array_equal(params[k], fast[0].params[k]) for k in params)
    assert groups[3].stats()["backup_dropped"] == 1 and groups[3].stats()["backup_skipped"] == 4
    # and all four go on together: the same parameters everywhere
    out = await asyncio.gather(*(o.step(_grads(5, g.rank)) for o, g in zip(opts, groups, strict=True)))
    assert all(np.array_equal(out[0][k], o[k]) for o in out for k in out[0])
    assert {o.step_count for o in opts} == {6}
    total = await asyncio.gather(*(g.all_reduce(np.ones(1)) for g in groups))  # the group is whole
    assert all(float(x[0]) == 4.0 for x in total)


@pytest.mark.asyncio
async def test_backup_is_refused_where_it_cannot_work(make_groups) -> None:
    ring = await make_groups(2, "ring")
    with pytest.raises(ValueError, match="backup=1 needs the ps topology"):
        psring.SyncSGD(ring[0], _model(0), backup=1)
    ps = await make_groups(2, "ps")
    for bad in (2, -1, "1", 1.0):
        with pytest.raises(ValueError, match=r"backup=.* must be an integer from 0 to 1"):
            psring.SyncSGD(ps[0], _model(0), backup=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backup=1 takes no compression: its scale is agreed over every worker"):
        psring.SyncSGD(ps[0], _model(0), backup=1, compression="fp16")


@pytest.mark.asyncio
async def test_a_straggler_that_accumulates_skips_ahead_at_its_exchange(make_groups) -> None:
    """accumulate=2 with backup=1: the sum is local, so a straggler's k-th call pushes late, is
    dropped, and takes the newest results like any straggler; then all go on together."""
    groups = await make_groups(4, "ps")
    opts = [psring.SyncSGD(g, _model(0), SGD(lr=0.1), backup=1, accumulate=2) for g in groups]
    await asyncio.gather(*(o.start() for o in opts))
    fast, slow = opts[:3], opts[3]
    for call in range(6):  # three steps of ranks 0-2; rank 3 does not call
        await asyncio.gather(*(o.step(_grads(call, g.rank)) for o, g in zip(fast, groups, strict=False)))
    assert {o.step_count for o in fast} == {3}
    want = {k: v.copy() for k, v in _model(0).items()}  # three of four, each step two calls averaged
    for t in range(3):
        for k in want:
            per_rank = [(_grads(2 * t, r)[k] + _grads(2 * t + 1, r)[k]) / np.float32(2) for r in range(3)]
            want[k] = want[k] - np.float32(0.1) * ((per_rank[0] + per_rank[1] + per_rank[2]) / np.float32(3))
    for k in want:
        np.testing.assert_allclose(fast[0].params[k], want[k], rtol=1e-6, atol=1e-7)
    assert (await slow.step(_grads(0, 3)))["w"] is slow.params["w"] and slow.step_count == 0  # summed only
    params = await slow.step(_grads(1, 3))
    assert slow.step_count == 3 and slow.skipped == 2
    assert all(np.array_equal(params[k], fast[0].params[k]) for k in params)
    for call in (6, 7):
        out = await asyncio.gather(*(o.step(_grads(call, g.rank)) for o, g in zip(opts, groups, strict=True)))
    assert all(np.array_equal(out[0][k], o[k]) for o in out for k in out[0])
    assert {o.step_count for o in opts} == {4}


@pytest.mark.asyncio
async def test_workers_that_disagree_on_backup_fail_together_named(make_groups) -> None:
    groups = await make_groups(3, "ps")
    opts = [psring.SyncSGD(g, _model(0), SGD(lr=0.1), backup=1 if g.rank != 2 else 0) for g in groups]
    results = await asyncio.gather(*(o.start() for o in opts), return_exceptions=True)
    assert all(isinstance(r, psring.MismatchError) for r in results), results
    assert all("rank(s) 2 set up a different optimizer, compression, accumulate, backup" in str(r) for r in results)
    # nothing applied, the group still usable
    total = await asyncio.gather(*(g.all_reduce(np.ones(1)) for g in groups))
    assert all(float(x[0]) == 3.0 for x in total)
