"""fp16 compression: float16 on the wire, float32 folds, the same bits on ring, ps and a local model."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import psring
from psring.core.compress import dequantize, fold_fp16, parse_codec_op, quantize, scale_exponent
from psring.errors import ProtocolError

pytestmark = [pytest.mark.timeout(120)]


def reference(xs: list[np.ndarray], op: str) -> np.ndarray:
    """The documented rule, computed locally from the inputs alone."""
    n = len(xs)
    amax = max(float(np.max(np.abs(x))) if x.size else 0.0 for x in xs)
    e = scale_exponent(amax, n)
    qs = [quantize(x.reshape(-1), e) for x in xs]
    return dequantize(fold_fp16(qs, op, e, np.empty(qs[0].size, np.float16)), e).reshape(xs[0].shape)


def test_scale_and_round_trip() -> None:
    x = np.array([1e-6, -3.0, 0.5, 7e-3], np.float32)
    e = scale_exponent(3.0, 4)
    assert 4 * 3.0 * 2.0**e <= 2**15 < 4 * 3.0 * 2.0 ** (e + 1)
    q = quantize(x, e)
    assert q.dtype == np.float16
    back = dequantize(q, e)
    assert back.dtype == np.float32
    np.testing.assert_allclose(back, x, rtol=1e-3, atol=3.0 * 2.0**-24)
    assert np.array_equal(quantize(back, e), q)  # the dequantized value is exactly representable
    assert scale_exponent(0.0, 3) == 0 and scale_exponent(float("inf"), 3) == 0 and scale_exponent(float("nan"), 3) == 0
    # tiny gradients are scaled up, not flushed to zero as a plain float16 cast would
    tiny = np.full(8, 1e-9, np.float32)
    assert np.all(tiny.astype(np.float16) == 0)
    et = scale_exponent(1e-9, 2)
    np.testing.assert_allclose(dequantize(quantize(tiny, et), et), tiny, rtol=1e-3)


def test_codec_op_parsing() -> None:
    assert parse_codec_op("avg") is None
    assert parse_codec_op("avg:fp16@12") == ("avg", 12)
    assert parse_codec_op("sum:fp16@-3") == ("sum", -3)
    for bad in ("max:fp16@1", "avg:fp8@1", "avg:fp16@x", "avg:fp16@1000", "avg:fp16"):
        with pytest.raises(ProtocolError, match="not a valid compressed reduction"):
            parse_codec_op(bad)


@pytest.mark.asyncio
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [0, 1, 1000, 300_001])
async def test_fp16_all_reduce_matches_the_rule_on_every_rank(
    make_groups, topology: str, world: int, size: int
) -> None:
    groups = await make_groups(world, topology)
    rng = np.random.default_rng(size + world)
    xs = [(rng.standard_normal(size) * 10.0 ** rng.integers(-6, 2)).astype(np.float32) for _ in range(world)]
    for op in ("avg", "sum"):
        ys = await asyncio.gather(
            *(g.all_reduce(x, op=op, compression="fp16") for g, x in zip(groups, xs, strict=True))
        )
        want = reference(xs, op)
        for y in ys:
            assert y.dtype == np.float32 and y.shape == (size,)
            assert np.array_equal(y.view(np.uint32), want.view(np.uint32))  # bit for bit
        exact = np.sum(np.stack(xs).astype(np.float64), axis=0) / (world if op == "avg" else 1)
        scale = max(1e-30, float(np.max(np.abs(np.stack(xs))))) * world if size else 1.0
        assert np.max(np.abs(ys[0] - exact), initial=0.0) <= scale * 2.0**-9  # float16 resolution of the largest sum


@pytest.mark.asyncio
async def test_fp16_halves_the_bytes(make_groups, topology: str) -> None:
    world = 4
    groups = await make_groups(world, topology)
    x = np.ones(4 << 20, np.float32)
    before = [g.stats()["bytes_sent"] for g in groups]
    await asyncio.gather(*(g.all_reduce(x, op="avg", compression="fp16") for g in groups))
    sent = [g.stats()["bytes_sent"] - b for g, b in zip(groups, before, strict=True)]
    plain = 2 * (world - 1) / world * x.nbytes if topology == "ring" else x.nbytes
    for s in sent:
        assert plain / 2 <= s <= plain / 2 * 1.01 + (64 << 10), (s, plain)


@pytest.mark.asyncio
async def test_fp16_halves_the_bytes_of_small_ring_calls_through_the_root(make_groups, monkeypatch) -> None:
    """A small fp16 all_reduce from 3 ranks goes through the rotating root like a plain one, and
    the root's result travels as float16 too: all ranks together send about half the bytes."""
    monkeypatch.setenv("PSRING_RING_BOARD", "0")  # the plain call on the links, not the same-host boards
    groups = await make_groups(4)
    x = np.ones(16_000, np.float32)  # 64 kB: the small path
    totals = {}
    for compression in (None, "fp16"):
        for _ in range(4):  # every rank is the root once
            before = sum(g.stats()["bytes_sent"] for g in groups)
            await asyncio.gather(*(g.all_reduce(x, op="avg", compression=compression) for g in groups))
            totals[compression] = totals.get(compression, 0) + sum(g.stats()["bytes_sent"] for g in groups) - before
    assert totals[None] >= 4 * 2 * 3 * x.nbytes  # 2(N-1) tensors a call
    assert totals["fp16"] <= 0.55 * totals[None], totals


@pytest.mark.asyncio
async def test_fp16_ring_and_ps_give_the_same_bits(make_groups) -> None:
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((3, 70_001)).astype(np.float32) * (r + 1) for r in range(3)]
    results = {}
    for topology in ("ring", "ps"):
        groups = await make_groups(3, topology)
        ys = await asyncio.gather(
            *(g.all_reduce(x, op="avg", compression="fp16") for g, x in zip(groups, xs, strict=True))
        )
        results[topology] = ys[0]
    assert np.array_equal(results["ring"].view(np.uint32), results["ps"].view(np.uint32))


@pytest.mark.asyncio
async def test_fp16_bad_use_is_named(make_groups, topology: str) -> None:
    groups = await make_groups(2, topology)
    with pytest.raises(TypeError, match=r"compression='fp16' needs float32 arrays, got float64"):
        await groups[0].all_reduce(np.ones(3), compression="fp16")
    with pytest.raises(ValueError, match=r"compression='fp16' works with op='sum' or op='avg', not op='max'"):
        await groups[0].all_reduce(np.ones(3, np.float32), op="max", compression="fp16")
    with pytest.raises(ValueError, match=r"compression='int4' is not one of"):  # int8 is a codec since #81
        await groups[0].all_reduce(np.ones(3, np.float32), compression="int4")
    # one rank compressing and the other not: a MismatchError on both, naming the op
    results = await asyncio.gather(
        groups[0].all_reduce(np.ones(3, np.float32), compression="fp16"),
        groups[1].all_reduce(np.ones(3, np.float32)),
        return_exceptions=True,
    )
    assert all(isinstance(r, psring.MismatchError) for r in results), results
    ys = await asyncio.gather(*(g.all_reduce(np.ones(3, np.float32), compression="fp16") for g in groups))
    assert all(np.array_equal(y, np.full(3, 2.0, np.float32)) for y in ys)
