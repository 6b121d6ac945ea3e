"""SyncSGD with sparse tables (sparse=[name]): the rows a step touched, summed over the workers in
rank order and averaged, updated by the optimizer alone; over ps the table lives on the shards and
workers pull the rows they need. Ring and ps bit-identical, and equal to a one-process rule."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import psring
from psring.core.sparse import merge_rows
from psring.optim import SGD, Adam
from psring.training.checkpoint import from_bytes, to_bytes

pytestmark = pytest.mark.timeout(60)

ROWS, WIDTH = 50, 4


def _params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"emb": rng.standard_normal((ROWS, WIDTH)).astype(np.float32), "w": np.ones(3, np.float32)}


def _grads(step: int, rank: int) -> dict[str, object]:
    rng = np.random.default_rng(1000 * step + rank)
    idx = rng.integers(0, ROWS, 6 + rank)  # duplicates happen
    rows = psring.SparseRows(idx, rng.standard_normal((idx.size, WIDTH)).astype(np.float32), ROWS)
    return {"emb": rows, "w": np.full(3, rank + 1.0, np.float32)}


def _reference(opt: psring.optim.Optimizer, world: int, steps: int) -> np.ndarray:
    table = _params()["emb"].copy()
    state = opt.init_state(table)
    for t in range(steps):
        parts = [_grads(t, r)["emb"] for r in range(world)]
        m = merge_rows([(p.indices, p.values) for p in parts], ROWS, WIDTH, np.float32)  # type: ignore[attr-defined]
        sub = table[m.indices]
        sub_state = {k: (v[m.indices] if isinstance(v, np.ndarray) else v) for k, v in state.items()}
        sub_state["step"] = t
        opt.update(sub, m.values / np.float32(world), sub_state)
        table[m.indices] = sub
        for k, v in sub_state.items():
            if isinstance(v, np.ndarray):
                state[k][m.indices] = v
    return table


async def _train(groups, make_opt, steps: int) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    opts = [psring.SyncSGD(g, _params(), make_opt(), sparse=["emb"]) for g in groups]
    await asyncio.gather(*(o.start() for o in opts))
    for t in range(steps):
        await asyncio.gather(*(o.step(_grads(t, g.rank)) for o, g in zip(opts, groups, strict=True)))
    everything = np.arange(ROWS)
    return await asyncio.gather(*(o.pull_rows("emb", everything) for o in opts)), opts  # type: ignore[return-value]


@pytest.mark.asyncio
@pytest.mark.parametrize("make_opt", [lambda: SGD(lr=0.1, momentum=0.9), lambda: Adam(lr=0.01)], ids=["sgd", "adam"])
async def test_ring_and_ps_tables_are_bit_identical_and_follow_the_rule(make_groups, make_opt) -> None:
    want = _reference(make_opt(), 3, 4)
    tables, dense = {}, {}
    for topology in ("ring", "ps"):
        groups = await make_groups(3, topology)
        pulled, opts = await _train(groups, make_opt, 4)
        for t in pulled:
            assert np.array_equal(t, want), topology  # every worker, bit for bit with the rule
        tables[topology] = pulled[0]
        if topology == "ps":  # the workers never hold the table
            assert all(o.model.tables["emb"] is None for o in opts)
        # the dense parameter went the usual way beside it: moved, the same everywhere
        assert all(np.array_equal(o.params["w"], opts[0].params["w"]) for o in opts)
        assert not np.array_equal(opts[0].params["w"], np.ones(3, np.float32)) and "emb" not in opts[0].params
        dense[topology] = opts[0].params["w"]
    assert np.array_equal(tables["ring"], tables["ps"]) and np.array_equal(dense["ring"], dense["ps"])


@pytest.mark.asyncio
@pytest.mark.parametrize("topology", ["ring", "ps"])
async def test_pull_rows_in_any_order_with_duplicates(make_groups, topology: str) -> None:
    groups = await make_groups(2, topology)
    opts = [psring.SyncSGD(g, _params(), SGD(lr=0.1), sparse=["emb"]) for g in groups]
    await asyncio.gather(*(o.start() for o in opts))
    idx = np.array([49, 0, 7, 7, 25])
    rows = await opts[1].pull_rows("emb", idx)
    assert np.array_equal(rows, _params()["emb"][idx])
    with pytest.raises(IndexError, match=r"index 50 is outside the table's rows 0\.\.49"):
        await opts[0].pull_rows("emb", np.array([1, 50]))
    with pytest.raises(KeyError, match="'w' is not a sparse table"):
        await opts[0].pull_rows("w", idx)


@pytest.mark.asyncio
@pytest.mark.parametrize("topology", ["ring", "ps"])
async def test_rows_prefetched_with_a_step_are_those_a_pull_after_it_reads(make_groups, topology: str) -> None:
    """step(grads, prefetch={name: ids}): over ps the shards send those rows back with the step's
    answer (after its update) and the next pull_rows of the same ids asks nobody; the table follows
    the same rule as without prefetching, and a pull of other ids still asks."""
    want = _reference(SGD(lr=0.1, momentum=0.9), 2, 3)
    groups = await make_groups(2, topology)
    opts = [psring.SyncSGD(g, _params(), SGD(lr=0.1, momentum=0.9), sparse=["emb"]) for g in groups]
    await asyncio.gather(*(o.start() for o in opts))
    everything = np.arange(ROWS)

    def asked(g: psring.Group) -> int:
        return int(getattr(getattr(g, "tables", None), "_pull_requests", 0))

    for t in range(3):
        ids = [np.array([49, 0, 7, 7, 25 + t]), np.arange(ROWS)[:: 3 + t]]
        await asyncio.gather(
            *(o.step(_grads(t, g.rank), prefetch={"emb": ids[g.rank]}) for o, g in zip(opts, groups, strict=True))
        )
        before = [asked(g) for g in groups]
        rows = await asyncio.gather(*(o.pull_rows("emb", ids[g.rank]) for o, g in zip(opts, groups, strict=True)))
        assert [asked(g) for g in groups] == before  # nothing asked: they came with the step
        fresh = await asyncio.gather(*(o.pull_rows("emb", ids[g.rank]) for o, g in zip(opts, groups, strict=True)))
        for r in range(2):
            assert np.array_equal(rows[r], fresh[r])  # what a pull after the step reads, bit for bit
        if topology == "ps":
            assert [asked(g) for g in groups] == [b + 1 for b in before]  # used once: the second one asked
    tables = await asyncio.gather(*(o.pull_rows("emb", everything) for o in opts))
    assert all(np.array_equal(t, want) for t in tables)  # the rule, as without prefetching
    with pytest.raises(IndexError, match=r"step\(prefetch\)\('emb'\): index 50 is outside"):
        await opts[0].step(_grads(3, 0), prefetch={"emb": np.array([50])})
    with pytest.raises(KeyError, match="'w' is not a sparse table"):
        await opts[0].step(_grads(3, 0), prefetch={"w": np.array([1])})


@pytest.mark.asyncio
@pytest.mark.parametrize("topology", ["ring", "ps"])
async def test_bad_rows_are_named_on_every_rank_and_nothing_is_applied(make_groups, topology: str) -> None:
    groups = await make_groups(2, topology)
    opts = [psring.SyncSGD(g, _params(), SGD(lr=0.1), sparse=["emb"]) for g in groups]
    await asyncio.gather(*(o.start() for o in opts))
    before = await opts[0].pull_rows("emb", np.arange(ROWS))
    bad = psring.SparseRows(np.array([3, 99]), np.ones((2, WIDTH), np.float32), ROWS)
    res = await asyncio.gather(
        opts[0].step(_grads(0, 0)), opts[1].step({"emb": bad, "w": np.ones(3, np.float32)}), return_exceptions=True
    )
    assert all(isinstance(r, ValueError) and "rank(s) 1" in str(r) and "outside the table's rows" in str(r)
               for r in res), res  # fmt: skip
    after = await opts[0].pull_rows("emb", np.arange(ROWS))
    assert np.array_equal(before, after)
    total = await asyncio.gather(*(g.all_reduce(np.ones(1)) for g in groups))  # the group goes on
    assert all(float(t[0]) == 2.0 for t in total)


@pytest.mark.asyncio
async def test_a_tables_step_takes_all_but_the_backup_workers_rows(make_groups) -> None:
    """backup=1 over ps: ranks 0-2 take five steps while rank 3 pushes nothing. Each table step applies
    their rows (the rule over three workers, bit for bit); rank 3's late step is dropped, it takes the
    answers of the steps taken without it, lands at the others' step with the same rows; then all four
    go on together."""
    groups = await make_groups(4, "ps")
    opts = [psring.SyncSGD(g, _params(), SGD(lr=0.1, momentum=0.9), sparse=["emb"], backup=1) for g in groups]
    await asyncio.gather(*(o.start() for o in opts))
    fast, slow = opts[:3], opts[3]
    for t in range(5):
        await asyncio.gather(*(o.step(_grads(t, g.rank)) for o, g in zip(fast, groups, strict=False)))
    everything = np.arange(ROWS)
    want = _reference(SGD(lr=0.1, momentum=0.9), 3, 5)
    for o in fast:
        assert np.array_equal(await o.pull_rows("emb", everything), want)
    await slow.step(_grads(0, 3))
    assert slow.step_count == 5 and slow.skipped == 4
    assert np.array_equal(await slow.pull_rows("emb", everything), want)
    await asyncio.gather(*(o.step(_grads(5, g.rank)) for o, g in zip(opts, groups, strict=True)))
    pulled = await asyncio.gather(*(o.pull_rows("emb", everything) for o in opts))
    assert all(np.array_equal(p, pulled[0]) for p in pulled) and not np.array_equal(pulled[0], want)
    assert {o.step_count for o in opts} == {6}


@pytest.mark.asyncio
async def test_what_a_sparse_table_refuses(make_groups) -> None:
    groups = await make_groups(2, "ring")
    g = groups[0]
    with pytest.raises(ValueError, match="'emb2' is not one of the parameters"):
        psring.SyncSGD(g, _params(), sparse=["emb2"])
    with pytest.raises(ValueError, match="must be a 2-D floating array"):
        psring.SyncSGD(g, _params(), sparse=["w"])
    with pytest.raises(ValueError, match="take no weight_decay"):
        psring.SyncSGD(g, _params(), SGD(lr=0.1, weight_decay=0.1), sparse=["emb"])
    with pytest.raises(ValueError, match="backup=1 needs the ps topology"):  # (sparse or not; over ps it steps)
        psring.SyncSGD(g, _params(), backup=1, sparse=["emb"])
    opt = psring.SyncSGD(g, _params(), SGD(lr=0.1), sparse=["emb"])
    opt.started = True  # no other rank here: step checks the rows before any exchange
    opt.model.tables["emb"] = _params()["emb"]
    with pytest.raises(TypeError, match=r"grads\['emb'\] must be a psring.SparseRows"):
        await opt.step({"emb": np.zeros((ROWS, WIDTH), np.float32), "w": np.ones(3, np.float32)})
    narrow = psring.SparseRows(np.array([1]), np.ones((1, 3), np.float32), ROWS)
    with pytest.raises(ValueError, match=r"grads\['emb'\] has rows of 50 x 3 float32; the table is 50 x 4"):
        await opt.step({"emb": narrow, "w": np.ones(3, np.float32)})


@pytest.mark.asyncio
@pytest.mark.parametrize("make_opt", [lambda: SGD(lr=0.1, momentum=0.9), lambda: Adam(lr=0.01)], ids=["sgd", "adam"])
async def test_a_checkpoint_with_sparse_tables_resumes_to_the_uninterrupted_runs_bits(
    make_groups, topology: str, make_opt
) -> None:
    """state_dict after 3 of 6 steps (through the checkpoint file's format), loaded by a fresh job: the
    table, its rows' optimizer state (momentum, Adam's moments, at the table's step) and the dense
    parameters end bit-identical to 6 steps straight. Over ps the table and its state are read from
    the shards and handed back to new ones. Before: NotImplementedError (psring#37, #61)."""
    straight, straight_opts = await _train(await make_groups(2, topology), make_opt, 6)
    _, opts = await _train(await make_groups(2, topology), make_opt, 3)
    states = await asyncio.gather(*(o.state_dict() for o in opts))
    assert all(np.array_equal(s["tables"]["emb"]["rows"], states[0]["tables"]["emb"]["rows"]) for s in states)
    saved = from_bytes(to_bytes({"sgd": states[0]}))["sgd"]
    resumed = [psring.SyncSGD(g, _params(), make_opt(), sparse=["emb"]) for g in await make_groups(2, topology)]
    for o in resumed:
        o.load_state_dict(saved)
    await asyncio.gather(*(o.start() for o in resumed))
    for t in range(3, 6):
        await asyncio.gather(*(o.step(_grads(t, r)) for r, o in enumerate(resumed)))
    tables = await asyncio.gather(*(o.pull_rows("emb", np.arange(ROWS)) for o in resumed))
    assert all(np.array_equal(t, straight[0]) for t in tables)
    assert all(np.array_equal(o.params["w"], straight_opts[0].params["w"]) for o in resumed)
    end, want = await resumed[0].state_dict(), await straight_opts[0].state_dict()
    assert end["step"] == want["step"] == 6
    for key, rows in want["tables"]["emb"]["state"].items():
        assert np.array_equal(end["tables"]["emb"]["state"][key], rows), key


@pytest.mark.asyncio
async def test_a_checkpoint_must_carry_the_tables(make_groups) -> None:
    groups = await make_groups(1, "ring")
    dense = await psring.SyncSGD(groups[0], {"w": np.ones(3, np.float32)}, SGD(lr=0.1)).state_dict()
    with pytest.raises(ValueError, match=r"the checkpoint has sparse tables \[\], this SyncSGD \['emb'\]"):
        psring.SyncSGD(groups[0], _params(), SGD(lr=0.1), sparse=["emb"]).load_state_dict(dense)
    _, opts = await _train(groups, lambda: SGD(lr=0.1, momentum=0.9), 1)
    saved = await opts[0].state_dict()
    saved["tables"]["emb"]["state"] = {}
    with pytest.raises(ValueError, match=r"sparse table 'emb' has optimizer state \{\}, the optimizer keeps"):
        psring.SyncSGD(groups[0], _params(), SGD(lr=0.1, momentum=0.9), sparse=["emb"]).load_state_dict(saved)


@pytest.mark.asyncio
async def test_accumulated_rows_are_each_micro_batchs_rows_merged_in_order_and_divided(make_groups, topology) -> None:
    """accumulate=2: the table steps as if each rank had pushed its two micro-batches' rows merged
    (merge_rows, in their order) and halved, as the dense gradients are averaged over the calls."""
    world, steps = 2, 3
    acc = [psring.SyncSGD(g, _params(), SGD(lr=0.1, momentum=0.9), sparse=["emb"], accumulate=2)
           for g in await make_groups(world, topology)]  # fmt: skip
    one = [psring.SyncSGD(g, _params(), SGD(lr=0.1, momentum=0.9), sparse=["emb"])
           for g in await make_groups(world, topology)]  # fmt: skip
    for t in range(steps):
        for micro in (2 * t, 2 * t + 1):
            out = await asyncio.gather(*(o.step(_grads(micro, r)) for r, o in enumerate(acc)))
        assert all(o.step_count == t + 1 for o in acc), [o.step_count for o in acc]
        mine = []
        for r in range(world):
            parts = [_grads(2 * t, r), _grads(2 * t + 1, r)]
            m = merge_rows([(p["emb"].indices, p["emb"].values) for p in parts], ROWS, WIDTH, np.float32)  # type: ignore[attr-defined]
            w = (parts[0]["w"] + parts[1]["w"]) / np.float32(2)  # type: ignore[operator]
            mine.append({"emb": psring.SparseRows(m.indices, m.values / np.float32(2), ROWS), "w": w})
        ref = await asyncio.gather(*(o.step(mine[r]) for r, o in enumerate(one)))
        np.testing.assert_array_equal(out[0]["w"], ref[0]["w"])
    everything = np.arange(ROWS)
    got = await asyncio.gather(*(o.pull_rows("emb", everything) for o in acc))
    want = await asyncio.gather(*(o.pull_rows("emb", everything) for o in one))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[0])
    assert not np.array_equal(got[0], _params()["emb"])
