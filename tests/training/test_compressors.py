"""SyncSGD's compressors with error feedback (psring.TopK, psring.PowerSGD) on both topologies: every
rank the same bits, ring == ps; error feedback kept in a checkpoint (a resumed run ends with the
uninterrupted run's bits); fewer bytes; bad settings refused."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import psring
from psring.optim import SGD
from psring.training.compressors import compression_from

pytestmark = [pytest.mark.timeout(120)]

SHAPES = {"w1": (64, 48), "b1": (48,), "w2": (48, 10), "b2": (10,)}


def start_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def grads(t: int, r: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(1000 * t + r)
    return {k: g.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


async def train(groups: list[Any], make: Any, steps: int, cut: int | None = None) -> list[dict[str, np.ndarray]]:
    opts = [psring.SyncSGD(g, start_params(), SGD(lr=0.05, momentum=0.9), compression=make()) for g in groups]
    await asyncio.gather(*(o.start() for o in opts))
    outs: list[dict[str, np.ndarray]] = []
    for t in range(steps if cut is None else cut):
        outs = await asyncio.gather(*(o.step(grads(t, g.rank)) for o, g in zip(opts, groups, strict=True)))
    if cut is None:
        return outs
    states = await asyncio.gather(*(o.state_dict() for o in opts))
    return [opts, states]  # type: ignore[list-item]


@pytest.mark.asyncio
@pytest.mark.parametrize("make", [lambda: psring.TopK(0.05), lambda: psring.PowerSGD(2)], ids=["topk", "powersgd"])
async def test_a_compressor_gives_the_same_bits_on_every_rank_and_both_topologies(make_groups, make: Any) -> None:
    world, steps = 3, 8
    ring = await train(await make_groups(world, "ring"), make, steps)
    ps = await train(await make_groups(world, "ps", servers_n=2), make, steps)
    for k in SHAPES:
        for r in range(world):
            assert np.array_equal(ring[r][k], ring[0][k]) and np.array_equal(ps[r][k], ring[0][k]), (k, r)
    # the parameters moved, and not as far from plain SGD as a lost gradient would leave them
    assert not np.array_equal(ring[0]["w1"], start_params()["w1"])


@pytest.mark.asyncio
@pytest.mark.parametrize("make", [lambda: psring.TopK(0.05), lambda: psring.PowerSGD(2)], ids=["topk", "powersgd"])
async def test_error_feedback_survives_a_checkpoint(make_groups, make: Any, topology: str) -> None:
    """4 steps, a checkpoint (every rank's error in it), a new job that loads rank 0's, 4 more: the
    uninterrupted run's bits."""
    world = 2
    whole = await train(await make_groups(world, topology), make, 8)
    _opts, states = await train(await make_groups(world, topology), make, 8, cut=4)
    assert len(states[0]["feedback"]) == world  # every rank's own error
    groups = await make_groups(world, topology)
    fresh = [psring.SyncSGD(g, start_params(), SGD(lr=0.05, momentum=0.9), compression=make()) for g in groups]
    for o in fresh:
        o.load_state_dict(states[0])
    await asyncio.gather(*(o.start() for o in fresh))
    outs: list[dict[str, np.ndarray]] = []
    for t in range(4, 8):
        outs = await asyncio.gather(*(o.step(grads(t, g.rank)) for o, g in zip(fresh, groups, strict=True)))
    for k in SHAPES:
        assert np.array_equal(outs[0][k], whole[0][k]) and np.array_equal(outs[1][k], whole[1][k]), k


@pytest.mark.asyncio
async def test_topk_sends_far_fewer_bytes(make_groups, topology: str) -> None:
    world = 4
    big = {"w": np.zeros((512, 512), np.float32)}

    async def sent(compression: Any) -> int:
        groups = await make_groups(world, topology)
        opts = [psring.SyncSGD(g, {k: v.copy() for k, v in big.items()}, SGD(lr=0.1), compression=compression)
                for g in groups]  # fmt: skip
        await asyncio.gather(*(o.start() for o in opts))
        before = sum(g.stats()["bytes_sent"] for g in groups)
        g_ = {"w": np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)}
        await asyncio.gather(*(o.step(g_) for o in opts))
        return sum(g.stats()["bytes_sent"] for g in groups) - before

    plain, topk, power = await sent(None), await sent(psring.TopK(0.01)), await sent(psring.PowerSGD(4))
    assert topk < plain / 5, (topk, plain)
    assert power < plain / 5, (power, plain)


def test_bad_settings_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"TopK\(ratio=0\): the share of each bucket sent must be in \(0, 1\]"):
        psring.TopK(0)
    with pytest.raises(ValueError, match=r"PowerSGD\(rank=0\): the rank must be a positive integer"):
        psring.PowerSGD(0)
    assert compression_from("topk:0.01").describe() == "topk:0.01"
    assert compression_from("powersgd:4").describe() == "powersgd:4" and compression_from("int8") == "int8"
    with pytest.raises(ValueError, match=r"is not a codec .* topk:RATIO or powersgd:RANK"):
        compression_from("zip:3")


@pytest.mark.asyncio
async def test_a_compressor_refuses_what_it_cannot_take(make_groups) -> None:
    (g,) = await make_groups(1, "ring")
    with pytest.raises(TypeError, match=r"compression='topk:0.01' needs float32 parameters, got float64"):
        psring.SyncSGD(g, {"w": np.zeros(4)}, compression=psring.TopK(0.01))
    ps = await make_groups(2, "ps")
    with pytest.raises(ValueError, match="elastic=True with a compressor needs the ring"):
        psring.SyncSGD(ps[0], start_params(), compression=psring.TopK(0.01), elastic=True)
    with pytest.raises(ValueError, match="backup=1 takes no compression"):
        psring.SyncSGD(ps[0], start_params(), compression=psring.PowerSGD(2), backup=1)


@pytest.mark.asyncio
@pytest.mark.parametrize("make", [lambda: psring.TopK(0.05), lambda: psring.PowerSGD(2)], ids=["topk", "powersgd"])
async def test_an_elastic_ring_with_a_compressor_gives_the_plain_runs_bits_when_nobody_leaves(
    make_groups, make: Any
) -> None:
    world = 3
    plain = await train(await make_groups(world, "ring"), make, 5)
    groups = await make_groups(world, "ring")
    opts = [psring.SyncSGD(g, start_params(), SGD(lr=0.05, momentum=0.9), compression=make(), elastic=True)
            for g in groups]  # fmt: skip
    await asyncio.gather(*(o.start() for o in opts))
    outs: list[dict[str, np.ndarray]] = []
    for t in range(5):
        outs = await asyncio.gather(*(o.step(grads(t, g.rank)) for o, g in zip(opts, groups, strict=True)))
    for k in SHAPES:
        assert all(np.array_equal(o[k], plain[0][k]) for o in outs), k
