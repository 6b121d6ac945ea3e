"""Local SGD / DiLoCo in SyncSGD (local_steps=H, outer=...): H = 1 with outer SGD(lr=1) is plain
SyncSGD to float rounding; ring == ps bit for bit (over ps the outer optimizer runs on the shards);
a one-process reference of the rule; codecs and compressors on the pseudo-gradients; H times fewer
exchanges; a checkpoint at a boundary resumes exactly; bad settings refused by name."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import psring
from psring.core.fold import canonical_fold
from psring.optim import SGD, Adam

pytestmark = [pytest.mark.timeout(120)]

SHAPES = {"w": (40, 30), "b": (30,)}


def start_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def grads(t: int, r: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(1000 * t + r)
    return {k: g.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def outer() -> SGD:
    return SGD(lr=0.7, momentum=0.9, nesterov=True)


async def train(groups: list[Any], steps: int, **kw: Any) -> list[Any]:
    inner = kw.pop("inner", lambda: Adam(lr=1e-2))
    opts = [psring.SyncSGD(g, start_params(), inner(), **kw) for g in groups]
    await asyncio.gather(*(o.start() for o in opts))
    outs: list[dict[str, np.ndarray]] = []
    for t in range(steps):
        outs = await asyncio.gather(*(o.step(grads(t, g.rank)) for o, g in zip(opts, groups, strict=True)))
    return [opts, outs]


def reference(world: int, steps: int, h: int) -> dict[str, np.ndarray]:
    """One process: every rank's inner Adam on its own copy; every h steps the canonical average of
    global - local, one outer Nesterov step, the copies reset to the global parameters."""
    names = list(SHAPES)
    flat = np.concatenate([start_params()[k].reshape(-1) for k in names])
    inner = Adam(lr=1e-2)
    local = [flat.copy() for _ in range(world)]
    states = [inner.init_state(local[r]) for r in range(world)]
    out = outer()
    ostate = out.init_state(flat)
    for t in range(steps):
        for r in range(world):
            g = np.concatenate([grads(t, r)[k].reshape(-1) for k in names])
            inner.update(local[r], g, states[r])
        if (t + 1) % h == 0:
            avg = canonical_fold([flat - local[r] for r in range(world)], "avg", np.empty_like(flat))
            out.update(flat, avg, ostate)
            for r in range(world):
                local[r][...] = flat
    res, off = {}, 0
    for k in names:
        n = int(np.prod(SHAPES[k]))
        res[k] = flat[off : off + n].reshape(SHAPES[k])
        off += n
    return res


@pytest.mark.asyncio
async def test_diloco_gives_the_rules_bits_on_every_rank_and_both_topologies(make_groups) -> None:
    world, h, steps = 3, 4, 12
    _, ring = await train(await make_groups(world, "ring"), steps, local_steps=h, outer=outer())
    _, ps = await train(await make_groups(world, "ps", servers_n=2), steps, local_steps=h, outer=outer())
    want = reference(world, steps, h)
    for k in SHAPES:
        for r in range(world):
            assert np.array_equal(ring[r][k], want[k]) and np.array_equal(ps[r][k], want[k]), (k, r)


@pytest.mark.asyncio
async def test_between_outer_steps_a_rank_sees_its_local_parameters(make_groups) -> None:
    groups = await make_groups(2, "ring")
    opts, outs = await train(groups, 3, local_steps=4, outer=outer())
    assert not np.array_equal(outs[0]["w"], outs[1]["w"])  # each rank's own inner steps
    assert opts[0].step_count == 0 and opts[0].local.inner_steps == 3
    outs = await asyncio.gather(*(o.step(grads(3, g.rank)) for o, g in zip(opts, groups, strict=True)))
    assert np.array_equal(outs[0]["w"], outs[1]["w"]) and opts[0].step_count == 1  # the outer step landed


@pytest.mark.asyncio
async def test_one_local_step_with_outer_sgd_of_lr_1_is_plain_syncsgd(make_groups, topology: str) -> None:
    groups = await make_groups(2, topology)
    _, local = await train(groups, 5, inner=lambda: SGD(lr=0.05), local_steps=1, outer=SGD(lr=1.0))
    _, plain = await train(await make_groups(2, topology), 5, inner=lambda: SGD(lr=0.05))
    for k in SHAPES:
        np.testing.assert_allclose(local[0][k], plain[0][k], rtol=0, atol=1e-5)


@pytest.mark.asyncio
@pytest.mark.parametrize("compression", ["int8", "bf16", "powersgd"])
async def test_codecs_and_compressors_carry_the_pseudo_gradients(make_groups, compression: str) -> None:
    def make() -> Any:
        return psring.PowerSGD(2) if compression == "powersgd" else compression

    world = 2
    _, ring = await train(await make_groups(world, "ring"), 8, local_steps=4, outer=outer(), compression=make())
    _, ps = await train(await make_groups(world, "ps"), 8, local_steps=4, outer=outer(), compression=make())
    for k in SHAPES:
        assert np.array_equal(ring[0][k], ring[1][k]) and np.array_equal(ring[0][k], ps[0][k]), k


@pytest.mark.asyncio
async def test_h_times_fewer_bytes(make_groups, topology: str) -> None:
    async def sent(**kw: Any) -> int:
        groups = await make_groups(2, topology)
        opts, _ = await train(groups, 0, **kw)
        before = sum(g.stats()["bytes_sent"] for g in groups)
        for t in range(8):
            await asyncio.gather(*(o.step(grads(t, g.rank)) for o, g in zip(opts, groups, strict=True)))
        return sum(g.stats()["bytes_sent"] for g in groups) - before

    plain, local = await sent(), await sent(local_steps=4, outer=outer())
    assert local < plain / 3, (local, plain)  # 2 exchanges against 8


@pytest.mark.asyncio
async def test_a_checkpoint_at_a_boundary_resumes_exactly(make_groups, topology: str) -> None:
    world, h = 2, 3
    _, whole = await train(await make_groups(world, topology), 9, local_steps=h, outer=outer())
    opts, _ = await train(await make_groups(world, topology), 6, local_steps=h, outer=outer())
    states = await asyncio.gather(*(o.state_dict() for o in opts))
    assert len(states[0]["inner"]) == world and states[0]["inner_steps"] == 6
    groups = await make_groups(world, topology)
    fresh = [psring.SyncSGD(g, start_params(), Adam(lr=1e-2), local_steps=h, outer=outer()) for g in groups]
    for o in fresh:
        o.load_state_dict(states[0])
    await asyncio.gather(*(o.start() for o in fresh))
    outs: list[dict[str, np.ndarray]] = []
    for t in range(6, 9):
        outs = await asyncio.gather(*(o.step(grads(t, g.rank)) for o, g in zip(fresh, groups, strict=True)))
    for k in SHAPES:
        assert np.array_equal(outs[0][k], whole[0][k]), k
    # between outer steps there is nothing whole to save
    await asyncio.gather(*(o.step(grads(9, g.rank)) for o, g in zip(fresh, groups, strict=True)))
    with pytest.raises(RuntimeError, match=r"state_dict between outer steps \(1 of 3 inner steps taken\)"):
        await fresh[0].state_dict()


@pytest.mark.asyncio
async def test_bad_settings_are_refused_naming_them(make_groups) -> None:
    (g,) = await make_groups(1, "ring")
    with pytest.raises(ValueError, match=r"local_steps=0 must be a positive integer"):
        psring.SyncSGD(g, start_params(), local_steps=0, outer=outer())
    ps = await make_groups(2, "ps")
    with pytest.raises(ValueError, match=r"local_steps=4 takes no backup workers"):
        psring.SyncSGD(ps[0], start_params(), local_steps=4, outer=outer(), backup=1)
    table = {"emb": np.zeros((10, 4), np.float32), **start_params()}
    with pytest.raises(ValueError, match=r"local_steps=4 takes no sparse tables"):
        psring.SyncSGD(g, table, local_steps=4, outer=outer(), sparse=["emb"])


@pytest.mark.asyncio
async def test_a_rank_whose_global_state_forked_is_named_and_repaired(make_groups) -> None:
    """After each outer step the ranks compare a digest of their global parameters and outer state: one
    rank whose copy differs (here, corrupted by hand between steps) takes the majority's; with no
    majority the job stops, naming the digests."""
    groups = await make_groups(3, "ring")
    opts, _ = await train(groups, 1, local_steps=2, outer=outer())
    opts[1].model.flat[0][0] += 1.0  # rank 1's global copy forks
    outs = await asyncio.gather(*(o.step(grads(1, g.rank)) for o, g in zip(opts, groups, strict=True)))
    assert all(o.repaired == 1 for o in opts)
    for k in SHAPES:
        assert np.array_equal(outs[1][k], outs[0][k]) and np.array_equal(outs[2][k], outs[0][k]), k
    two = await make_groups(2, "ring")
    opts, _ = await train(two, 1, local_steps=2, outer=outer())
    opts[1].model.flat[0][0] += 1.0
    got = await asyncio.gather(*(o.step(grads(1, g.rank)) for o, g in zip(opts, two, strict=True)),
                               return_exceptions=True)  # fmt: skip
    assert all(isinstance(e, psring.MismatchError) and "no majority" in str(e) for e in got), got
