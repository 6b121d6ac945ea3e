"""Every codec of psring.core.codec on both topologies: the same bits on every rank, on the ring, on the
parameter server and in a one-process reference that folds the inputs by the codec's own rule; the
error bound docs/api.md states; bad input refused by name."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import psring
from psring.core.codec import BF16, CODECS, FP16, INT8, INT8_BLOCK, Codec, Int8Scale, codec_named, parse_descriptor
from psring.errors import ProtocolError

pytestmark = [pytest.mark.timeout(120)]


def agreed_scale(codec: Codec, xs: list[np.ndarray]) -> object:
    """The scale the ranks agree on: from the elementwise max over the ranks of each one's amax."""
    if not codec.scaled:
        return 0
    return codec.scale(np.max(np.stack([codec.amax(x.reshape(-1)) for x in xs]), axis=0), len(xs))


def reference(codec: Codec, xs: list[np.ndarray], op: str) -> np.ndarray:
    """The documented rule, from the inputs alone: the agreed scale, every rank's encoding, the fold."""
    e = agreed_scale(codec, xs)
    qs = [codec.encode(x.reshape(-1), e) for x in xs]
    return codec.decode(codec.fold(qs, op, e, np.empty(qs[0].size, codec.wire)), e).reshape(xs[0].shape)


#: |error| of one rank's encoded value, relative to the value (bf16: 8 bits of mantissa, rounded)
RELATIVE = {"bf16": 2.0**-8}


def test_bf16_rounds_to_nearest_even_and_keeps_float32s_range() -> None:
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 1e-38, 3e38, np.inf, -np.inf, 0.0, -0.0], np.float32)
    q = BF16.encode(x, 0)
    assert q.dtype == np.uint16
    back = BF16.decode(q, 0)
    # ties to even: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7 and goes to 1; 1 + 3*2^-8 goes up
    assert back[0] == 1.0 and back[1] == 1.0 and back[2] == np.float32(1.0 + 2**-6)
    assert back[3] == -2.5 and np.isinf(back[6]) and np.isinf(back[7]) and np.signbit(back[9])
    assert 0.9e-38 < back[4] < 1.1e-38  # a float16 would flush it; bfloat16 has float32's exponent
    assert np.isfinite(back[5]) and abs(back[5] - 3e38) <= 3e38 * 2**-8
    assert np.array_equal(BF16.encode(back, 0), q)  # a decoded value is exactly representable
    nan = BF16.decode(BF16.encode(np.array([np.nan, -np.nan], np.float32), 0), 0)
    assert np.isnan(nan).all()


def test_names_and_descriptors() -> None:
    assert set(CODECS) >= {"fp16", "bf16"} and codec_named("bf16") is BF16 and codec_named(FP16) is FP16
    assert codec_named(None) is None
    assert parse_descriptor("avg:bf16@0") == ("avg", BF16, 0)
    assert parse_descriptor("sum:fp16@-3") == ("sum", FP16, -3)
    assert parse_descriptor("avg") is None
    for bad in ("avg:zstd@0", "max:bf16@0", "avg:bf16@x"):
        with pytest.raises(ProtocolError, match="not a valid compressed reduction"):
            parse_descriptor(bad)
    assert parse_descriptor("avg:int8@123456") == ("avg", INT8, 123456)
    with pytest.raises(ValueError, match=r"compression='int4' is not one of: None, 'fp16', 'bf16', 'int8'"):
        codec_named("int4")


@pytest.mark.asyncio
@pytest.mark.parametrize("name", sorted(CODECS))
async def test_bad_input_is_refused_naming_it(make_groups, name: str) -> None:
    (g,) = await make_groups(1, "ring")
    with pytest.raises(TypeError, match=rf"compression='{name}' needs float32 arrays, got float64"):
        await g.all_reduce(np.ones(3), compression=name)
    with pytest.raises(ValueError, match=rf"compression='{name}' works with op='sum' or op='avg', not op='max'"):
        await g.all_reduce(np.ones(3, np.float32), op="max", compression=name)
    with pytest.raises(ValueError, match="compression='nope' is not one of"):
        await g.all_reduce(np.ones(3, np.float32), compression="nope")


@pytest.mark.asyncio
@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [0, 1, 1000, 300_001])
async def test_a_codec_gives_the_rules_bits_on_every_rank_of_both_topologies(
    make_groups, topology: str, name: str, world: int, size: int
) -> None:
    codec = CODECS[name]
    groups = await make_groups(world, topology)
    rng = np.random.default_rng(size + world)
    xs = [(rng.standard_normal(size) * 10.0 ** rng.integers(-6, 2)).astype(np.float32) for _ in range(world)]
    for op in ("avg", "sum"):
        ys = await asyncio.gather(*(g.all_reduce(x, op=op, compression=name) for g, x in zip(groups, xs, strict=True)))
        want = reference(codec, xs, op)
        for y in ys:
            assert y.dtype == np.float32 and y.shape == (size,)
            assert np.array_equal(y.view(np.uint32), want.view(np.uint32))  # bit for bit
        exact = np.sum(np.stack(xs).astype(np.float64), axis=0) / (world if op == "avg" else 1)
        if name in RELATIVE:
            # each of the N-1 hops and the last rounding loses at most half a unit of the partial sum's
            # bfloat16: |err| <= N * 2^-8 * (the sum of |x| over the ranks), elementwise (docs/api.md)
            bound = world * RELATIVE[name] * np.sum(np.abs(np.stack(xs)), axis=0) / (world if op == "avg" else 1)
            assert np.all(np.abs(ys[0] - exact) <= bound + 1e-45)
        elif name == "int8" and size:
            # each rank's rounding is at most half a step of its block (2**-e); the sums are exact; avg's
            # last division rounds once more: sum <= N/2 steps, avg <= 1 step (docs/api.md)
            step = 1.0 / agreed_scale(codec, xs).factors(0, size).astype(np.float64)
            bound = step * (world / 2 if op == "sum" else 1.0)
            assert np.all(np.abs(ys[0] - exact) <= bound * (1 + 1e-6))
        elif size:
            scale = float(np.max(np.abs(np.stack(xs)))) * world
            assert np.max(np.abs(ys[0] - exact)) <= scale * 2.0**-9


def test_int8_scales_leave_room_for_every_sum_and_refuse_what_int8_cannot_carry() -> None:
    rng = np.random.default_rng(5)
    n = 3 * INT8_BLOCK + 17
    for world in (1, 2, 4, 7):
        xs = [(rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n // INT8_BLOCK + 1).repeat(INT8_BLOCK)[:n])
              .astype(np.float32) for _ in range(world)]  # fmt: skip
        e = agreed_scale(INT8, xs)
        assert isinstance(e, Int8Scale) and len(e.exps) == 4
        qs = [INT8.encode(x, e).astype(np.int32) for x in xs]
        assert np.max(np.abs(np.sum(qs, axis=0))) <= 127  # no partial sum leaves int8
        # decoding is exact, and a decoded value encodes to itself
        back = INT8.decode(qs[0].astype(np.int8), e)
        assert np.array_equal(INT8.encode(back, e), qs[0].astype(np.int8))
        # a window of the scales (a ps push's) decodes its elements alike
        lo, hi = INT8_BLOCK + 5, 3 * INT8_BLOCK + 9
        w = INT8.read_scale(INT8.wire_scale(e, lo, hi))
        assert np.array_equal(INT8.decode(qs[0][lo:hi].astype(np.int8), w, offset=lo), back[lo:hi])
    with pytest.raises(ValueError, match=r"cannot carry non-finite values: block 1 \(elements 1024..2047\)"):
        INT8.scale(np.array([1.0, np.inf], np.float32), 2)
    with pytest.raises(ValueError, match="at most 126 ranks, not 300"):
        INT8.scale(np.array([1.0], np.float32), 300)
    with pytest.raises(ProtocolError, match="not \\[first block, exponents\\]"):
        INT8.read_scale([0, "x"])


@pytest.mark.asyncio
async def test_bf16_halves_the_bytes_and_agrees_on_no_scale(make_groups, topology: str) -> None:
    world = 4
    groups = await make_groups(world, topology)
    x = np.ones(4 << 20, np.float32)
    await asyncio.gather(*(g.all_reduce(x) for g in groups))
    before = [g.stats()["bytes_sent"] for g in groups]
    ys = await asyncio.gather(*(g.all_reduce(x, op="avg", compression="bf16") for g in groups))
    coded = [g.stats()["bytes_sent"] - b for g, b in zip(groups, before, strict=True)]
    plain = 2 * (world - 1) / world * x.nbytes if topology == "ring" else x.nbytes  # what float32 would send
    for s in coded:
        assert plain / 2 <= s <= plain / 2 * 1.01 + (64 << 10), (s, plain)
    assert all(np.array_equal(y, x) for y in ys)  # 1.0 is exact in bfloat16
    # one collective, #1 (fp16 takes two: its scale's max all_reduce first)
    for g in groups:
        called = g.recent(1)
        assert called is not None and called.desc[3] == "avg:bf16@0" and g.recent(2) is None


@pytest.mark.asyncio
@pytest.mark.parametrize(("name", "drift"), [("bf16", 0.05), ("int8", 1.0)])
async def test_syncsgd_with_a_codec_ring_ps_and_one_process_agree_bit_for_bit(make_groups, name: str,
                                                                             drift: float) -> None:  # fmt: skip
    from psring.core.fold import canonical_fold
    from psring.optim import SGD

    world, steps = 3, 20
    rng = np.random.default_rng(3)
    start = {"w": rng.standard_normal((40, 30)).astype(np.float32), "b": rng.standard_normal(30).astype(np.float32)}

    def grads(t: int, r: int) -> dict[str, np.ndarray]:
        g = np.random.default_rng(1000 * t + r)
        return {k: g.standard_normal(v.shape).astype(np.float32) for k, v in start.items()}

    async def train(groups: list[psring.Group]) -> list[dict[str, np.ndarray]]:
        opts = [psring.SyncSGD(g, {k: v.copy() for k, v in start.items()}, SGD(lr=0.05, momentum=0.9),
                               compression=name) for g in groups]  # fmt: skip
        await asyncio.gather(*(o.start() for o in opts))
        outs: list[dict[str, np.ndarray]] = []
        for t in range(steps):
            outs = await asyncio.gather(*(o.step(grads(t, g.rank)) for o, g in zip(opts, groups, strict=True)))
        return outs

    ring = await train(await make_groups(world, "ring"))
    ps = await train(await make_groups(world, "ps", servers_n=2))
    # one process: the same rule per bucket (SyncSGD's one bucket here: the parameters in order)
    opt = SGD(lr=0.05, momentum=0.9)
    flat = np.concatenate([v.reshape(-1) for v in start.values()])
    state = opt.init_state(flat)
    plain_flat, plain_state = flat.copy(), opt.init_state(flat)
    for t in range(steps):
        parts = [np.concatenate([g.reshape(-1) for g in grads(t, r).values()]) for r in range(world)]
        opt.update(flat, reference(CODECS[name], parts, "avg"), state)
        opt.update(plain_flat, canonical_fold(parts, "avg", np.empty_like(flat)), plain_state)
    want = {"w": flat[: 40 * 30].reshape(40, 30), "b": flat[40 * 30 :]}
    for k in start:
        for r in range(world):
            assert np.array_equal(ring[r][k], want[k]) and np.array_equal(ps[r][k], want[k]), (k, r)
    np.testing.assert_allclose(flat, plain_flat, rtol=0, atol=drift)  # the codec's rounding, no more
