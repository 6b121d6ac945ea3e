"""Streaming local SGD (SyncSGD(..., local_steps=H, outer=..., fragments=K)): fragment i's exchange starts
after the inner steps t % H == i*H//K and is applied H//K inner steps later, overlapping them; the ring,
the parameter server and a one-process model of the rule give the same bits, on every rank; the
fragments are whole parameters about equal in bytes; bad settings are refused by name."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import psring
from psring.core.fold import canonical_fold
from psring.optim import SGD, Adam
from psring.training.streaming import split_params

pytestmark = [pytest.mark.timeout(120)]

SHAPES = {"w1": (40, 30), "b1": (30,), "w2": (30, 20), "b2": (20,)}


def start_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def grads(t: int, r: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(7000 * t + r)
    return {k: g.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def outer() -> SGD:
    return SGD(lr=0.7, momentum=0.9, nesterov=True)


async def train(groups: list[Any], steps: int, **kw: Any) -> tuple[list[Any], list[dict[str, np.ndarray]]]:
    opts = [psring.SyncSGD(g, start_params(), Adam(lr=1e-2), outer=outer(), **kw) for g in groups]
    await asyncio.gather(*(o.start() for o in opts))
    outs: list[dict[str, np.ndarray]] = []
    for t in range(steps):
        outs = await asyncio.gather(*(o.step(grads(t, g.rank)) for o, g in zip(opts, groups, strict=True)))
    return opts, outs


def reference(world: int, steps: int, h: int, k: int) -> tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """One process: every rank's inner Adam on its own copy; after inner step t (from 1) with
    t % h == i*h//k, fragment i's pseudo-gradients averaged in the canonical order and its outer step
    taken; h//k steps later every rank's copy of fragment i = new global + the progress since then."""
    names = list(SHAPES)
    sizes = [int(np.prod(SHAPES[n])) * 4 for n in names]
    starts = split_params(sizes, k)
    frags = [names[a:z] for a, z in zip(starts, [*starts[1:], len(names)], strict=True)]

    def flat_of(d: dict[str, np.ndarray], f: int) -> np.ndarray:
        return np.concatenate([d[n].reshape(-1) for n in frags[f]])

    inner, out = Adam(lr=1e-2), outer()
    glob = [flat_of(start_params(), f) for f in range(k)]
    local = [[g.copy() for g in glob] for _ in range(world)]
    states = [[inner.init_state(x) for x in local[r]] for r in range(world)]
    ostate = [out.init_state(g) for g in glob]
    offsets, delay = [(i * h) // k for i in range(k)], h // k
    pending: tuple[int, int, list[np.ndarray]] | None = None
    for t in range(1, steps + 1):
        for r in range(world):
            g = grads(t - 1, r)
            for f in range(k):
                inner.update(local[r][f], flat_of(g, f), states[r][f])
        if pending is not None and pending[1] == t:
            f, _due, snaps = pending
            for r in range(world):
                local[r][f][...] = glob[f] + (local[r][f] - snaps[r])
            pending = None
        if t % h in offsets:
            f = offsets.index(t % h)
            snaps = [local[r][f].copy() for r in range(world)]
            avg = canonical_fold([glob[f] - local[r][f] for r in range(world)], "avg", np.empty_like(glob[f]))
            out.update(glob[f], avg, ostate[f])  # its value is known now; the ranks apply it at t + delay
            pending = (f, t + delay, snaps)

    def by_name(flats: list[np.ndarray]) -> dict[str, np.ndarray]:
        res = {}
        for f, ns in enumerate(frags):
            off = 0
            for n in ns:
                size = int(np.prod(SHAPES[n]))
                res[n] = flats[f][off : off + size].reshape(SHAPES[n])
                off += size
        return res

    return [by_name(local[r]) for r in range(world)], by_name(glob)


def test_fragments_are_whole_parameters_about_equal_in_bytes() -> None:
    assert split_params([100, 100, 100, 100], 2) == [0, 2]
    assert split_params([4800, 120, 2400, 80], 2) == [0, 1]
    assert split_params([1, 1000, 1, 1], 3) == [0, 1, 2]  # every fragment at least one parameter
    assert split_params([5, 5, 5], 3) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"fragments=4: the model has 3 dense parameter\(s\)"):
        split_params([5, 5, 5], 4)


@pytest.mark.asyncio
@pytest.mark.parametrize("h,k", [(4, 2), (6, 3)])
async def test_streaming_gives_the_rules_bits_on_every_rank_and_both_topologies(make_groups, h: int, k: int) -> None:
    world, steps = 3, 3 * h + 1
    ring_opts, ring = await train(await make_groups(world, "ring"), steps, local_steps=h, fragments=k)
    ps_opts, ps = await train(await make_groups(world, "ps", servers_n=2), steps, local_steps=h, fragments=k)
    want_local, want_global = reference(world, steps, h, k)
    for r in range(world):
        for n in SHAPES:
            assert np.array_equal(ring[r][n], want_local[r][n]), ("ring local", r, n)
            assert np.array_equal(ps[r][n], want_local[r][n]), ("ps local", r, n)
    globals_ = await asyncio.gather(*(o.global_params() for o in [*ring_opts, *ps_opts]))
    for got in globals_:
        for n in SHAPES:
            assert np.array_equal(got[n], want_global[n]), n
    # the outer steps applied (every fragment's, at its due step); the last one started is still in flight
    applied = len([t for t in range(1, steps + 1) if t % (h // k) == 0]) - 1
    assert ring_opts[0].step_count == ps_opts[0].step_count == sum(ring_opts[0].streaming.rounds) == applied
    assert ring_opts[0].streaming.flight is not None


@pytest.mark.asyncio
async def test_an_exchange_runs_on_while_the_next_inner_steps_are_taken(make_groups, topology: str) -> None:
    """After the step that starts fragment i's exchange, the step returns with it in flight; the local
    copies take no outer step until its due step, when it lands on every rank at once."""
    groups = await make_groups(2, topology)
    opts, _ = await train(groups, 0, local_steps=4, fragments=2)
    for t in range(4):  # fragment 1 starts after inner step 2 (applied at 4), fragment 0 after step 4
        await asyncio.gather(*(o.step(grads(t, g.rank)) for o, g in zip(opts, groups, strict=True)))
    flight = opts[0].streaming.flight
    assert flight is not None and flight.fragment == 0 and flight.due == 6 and opts[0].step_count == 1
    await asyncio.gather(*(o.step(grads(4, g.rank)) for o, g in zip(opts, groups, strict=True)))
    assert opts[0].step_count == 1  # landed or not, it is applied at step 6, not before
    await asyncio.gather(*(o.step(grads(5, g.rank)) for o, g in zip(opts, groups, strict=True)))
    assert [o.step_count for o in opts] == [2, 2] and opts[0].streaming.flight.fragment == 1


@pytest.mark.asyncio
async def test_fragments_send_a_kth_of_the_model_each_time(make_groups) -> None:
    """Over H steps every fragment is exchanged once: the bytes of one plain local SGD round."""

    async def sent(**kw: Any) -> int:
        groups = await make_groups(2, "ring")
        opts, _ = await train(groups, 0, **kw)
        before = sum(g.stats()["bytes_sent"] for g in groups)
        for t in range(8):
            await asyncio.gather(*(o.step(grads(t, g.rank)) for o, g in zip(opts, groups, strict=True)))
        await asyncio.gather(*(o.global_params() for o in opts))
        return sum(g.stats()["bytes_sent"] for g in groups) - before

    plain, streamed = await sent(local_steps=4), await sent(local_steps=4, fragments=2)
    assert 0.8 * plain < streamed < 1.5 * plain, (streamed, plain)  # (+ one small digest a fragment)


@pytest.mark.asyncio
async def test_codecs_carry_a_fragments_pseudo_gradients_alike_on_both_topologies(make_groups) -> None:
    _, ring = await train(await make_groups(2, "ring"), 9, local_steps=4, fragments=2, compression="int8")
    _, ps = await train(await make_groups(2, "ps"), 9, local_steps=4, fragments=2, compression="int8")
    for n in SHAPES:
        assert np.array_equal(ring[0][n], ps[0][n]) and np.array_equal(ring[1][n], ps[1][n]), n


@pytest.mark.asyncio
async def test_bad_fragment_settings_are_refused_naming_them(make_groups) -> None:
    (g,) = await make_groups(1, "ring")
    with pytest.raises(ValueError, match=r"fragments=2 needs local_steps > 1"):
        psring.SyncSGD(g, start_params(), fragments=2)
    with pytest.raises(ValueError, match=r"fragments=0 must be a positive integer"):
        psring.SyncSGD(g, start_params(), local_steps=4, outer=outer(), fragments=0)
    with pytest.raises(ValueError, match=r"fragments=4 needs at least as many local_steps \(got 3\)"):
        psring.SyncSGD(g, start_params(), local_steps=3, outer=outer(), fragments=4)
    with pytest.raises(ValueError, match=r"fragments=5: the model has 4 dense parameter"):
        psring.SyncSGD(g, start_params(), local_steps=8, outer=outer(), fragments=5)
    with pytest.raises(ValueError, match=r"fragments=2 takes a codec .* not a compressor"):
        psring.SyncSGD(g, start_params(), local_steps=8, outer=outer(), fragments=2, compression=psring.TopK(0.1))
    opts, _ = await train([g], 2, local_steps=4, fragments=2)
    with pytest.raises(RuntimeError, match=r"state_dict with fragments=2: not yet"):
        await opts[0].state_dict()
    assert opts[0].setup()["streaming"] == {"fragments": 2, "buckets": [[0], [1]]}


@pytest.mark.asyncio
async def test_a_rank_whose_global_state_forked_is_repaired_when_the_next_fragment_lands(make_groups) -> None:
    """The digests travel with each fragment's exchange and are judged where it lands: a rank whose global
    copy was corrupted (by hand, between steps) takes the majority's; the ranks' global state then agrees."""
    groups = await make_groups(3, "ring")
    opts, _ = await train(groups, 1, local_steps=4, fragments=2)
    opts[1].model.flat[0][0] += 1.0  # rank 1's global copy of fragment 0 forks
    for t in range(1, 6):  # fragment 1 starts after step 2 and lands at step 4: the fork is seen there
        await asyncio.gather(*(o.step(grads(t, g.rank)) for o, g in zip(opts, groups, strict=True)))
    assert [o.repaired for o in opts] == [1, 1, 1]
    got = await asyncio.gather(*(o.global_params() for o in opts))
    for n in SHAPES:
        assert np.array_equal(got[1][n], got[0][n]) and np.array_equal(got[2][n], got[0][n]), n
