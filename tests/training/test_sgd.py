"""Optimizers against closed-form references; SyncSGD agreement across ranks and topologies;
parameter mode's exactly-once updates and checkpoint/restore across a SIGKILLed server."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time

import numpy as np
import pytest

import psring
from psring.optim import SGD, Adam, AdamW, Optimizer
from psring.training.sgd import make_buckets

from ..conftest import end, ps_workers, spawn_server

pytestmark = [pytest.mark.timeout(120)]


# ------------------------------------------------------------- optimizers
def _run(opt: Optimizer, p0: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    p = p0.copy()
    state = opt.init_state(p)
    for g in grads:
        opt.update(p, g, state)
    return p


def test_sgd_momentum_matches_torch_formula() -> None:
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(50)
    grads = [rng.standard_normal(50) for _ in range(5)]
    lr, mu, wd = 0.1, 0.9, 0.01
    p, buf = p0.copy(), None
    for g in grads:  # torch.optim.SGD, written out
        d = g + wd * p
        buf = d.copy() if buf is None else mu * buf + d
        p = p - lr * buf
    np.testing.assert_allclose(_run(SGD(lr=lr, momentum=mu, weight_decay=wd), p0, grads), p, rtol=1e-12)
    p, buf = p0.copy(), None
    for g in grads:  # nesterov
        buf = g.copy() if buf is None else mu * buf + g
        p = p - lr * (g + mu * buf)
    np.testing.assert_allclose(_run(SGD(lr=lr, momentum=mu, nesterov=True), p0, grads), p, rtol=1e-12)
    np.testing.assert_allclose(_run(SGD(lr=lr), p0, grads), p0 - lr * sum(grads), rtol=1e-12)


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_and_adamw_match_torch_formula(decoupled: bool) -> None:
    rng = np.random.default_rng(1)
    p0 = rng.standard_normal(40)
    grads = [rng.standard_normal(40) for _ in range(6)]
    lr, (b1, b2), eps, wd = 0.01, (0.9, 0.999), 1e-8, 0.05
    p, m, v = p0.copy(), np.zeros(40), np.zeros(40)
    for t, g in enumerate(grads, start=1):
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr / (1 - b1**t) * m / (np.sqrt(v) / math.sqrt(1 - b2**t) + eps)
    opt = AdamW(lr=lr, weight_decay=wd) if decoupled else Adam(lr=lr, weight_decay=wd)
    np.testing.assert_allclose(_run(opt, p0, grads), p, rtol=1e-10)


def test_optimizer_config_round_trips_and_rejects_bad_values() -> None:
    for opt in (SGD(lr=0.5, momentum=0.9, nesterov=True), Adam(lr=0.1, betas=(0.8, 0.99)), AdamW()):
        again = Optimizer.from_config(opt.config())
        assert type(again) is type(opt) and again.config() == opt.config()
    with pytest.raises(ValueError, match="lr"):
        SGD(lr=-1)
    with pytest.raises(ValueError, match="nesterov"):
        SGD(lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="unknown optimizer"):
        Optimizer.from_config({"name": "lamb"})


def test_update_on_slices_equals_update_on_the_whole() -> None:
    """What lets shards (slices) and ring ranks (whole buckets) agree bit for bit."""
    rng = np.random.default_rng(2)
    p0 = rng.standard_normal(1001).astype(np.float32)
    grads = [rng.standard_normal(1001).astype(np.float32) for _ in range(4)]
    for opt in (SGD(lr=0.1, momentum=0.9), Adam(lr=0.01)):
        whole = _run(opt, p0, grads)
        p = p0.copy()
        states = [opt.init_state(p[a:b]) for a, b in ((0, 333), (333, 1001))]
        for g in grads:
            for (a, b), st in zip(((0, 333), (333, 1001)), states, strict=True):
                opt.update(p[a:b], g[a:b], st)
        assert np.array_equal(p, whole)


def test_buckets_group_by_dtype_and_size() -> None:
    params = {"a": np.zeros(10, np.float32), "b": np.zeros(5, np.float64), "c": np.zeros(300, np.float32)}
    buckets = make_buckets(params, bucket_bytes=1024)
    layout = [(b.names, str(np.dtype(b.dtype))) for b in buckets]
    assert layout == [(["a"], "float32"), (["b"], "float64"), (["c"], "float32")]
    assert [b.names for b in make_buckets(params)] == [["a", "c"], ["b"]]


# ------------------------------------------------------------- SyncSGD
def _model(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((200, 100)).astype(np.float32),  # > 64 KiB: split over shards
        "b": rng.standard_normal(100).astype(np.float32),
        "s": np.float32(rng.standard_normal(1)).reshape(()),
    }


def _grads(step: int, rank: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 * step + rank)
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in _model(0).items()}


async def _train(groups, opt_factory, steps: int, **kw) -> list[dict[str, np.ndarray]]:
    opts = [psring.SyncSGD(g, _model(g.rank), opt_factory(), **kw) for g in groups]
    outs = []
    for t in range(steps):
        outs = await asyncio.gather(*(o.step(_grads(t, g.rank)) for o, g in zip(opts, groups, strict=True)))
    return outs


def _reference(opt: Optimizer, world: int, steps: int, compression: str | None = None) -> dict[str, np.ndarray]:
    """Single process: the same averaged gradients (canonical order), the same optimizer."""
    from psring.core.compress import dequantize, fold_fp16, quantize, scale_exponent
    from psring.core.fold import canonical_fold

    params = {k: v.copy() for k, v in _model(0).items()}  # rank 0's parameters win
    flat = np.concatenate([v.reshape(-1) for v in params.values()])
    state = opt.init_state(flat)
    for t in range(steps):
        parts = [np.concatenate([g.reshape(-1) for g in _grads(t, r).values()]) for r in range(world)]
        if compression == "fp16":
            e = scale_exponent(max(float(np.max(np.abs(p))) for p in parts), world)
            q = fold_fp16([quantize(p, e) for p in parts], "avg", e, np.empty(flat.size, np.float16))
            avg = dequantize(q, e)
        else:
            avg = canonical_fold(parts, "avg", np.empty_like(flat))
        opt.update(flat, avg, state)
    out, off = {}, 0
    for k, v in params.items():
        out[k] = flat[off : off + v.size].reshape(v.shape)
        off += v.size
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("opt_factory", [lambda: SGD(lr=0.05, momentum=0.9), lambda: Adam(lr=0.01)])
async def test_syncsgd_ring_ps_and_single_process_agree_bit_for_bit(make_groups, opt_factory) -> None:
    steps, world = 100, 3
    ring = await _train(await make_groups(world, "ring"), opt_factory, steps)
    ps = await _train(await make_groups(world, "ps", servers_n=2), opt_factory, steps)
    ref = _reference(opt_factory(), world, steps)
    for k in ref:
        for r in range(world):
            assert np.array_equal(ring[r][k], ring[0][k]) and np.array_equal(ps[r][k], ps[0][k])
        assert np.array_equal(ring[0][k], ps[0][k]), k
        assert np.array_equal(ring[0][k], ref[k]), k


@pytest.mark.asyncio
@pytest.mark.parametrize("opt_factory", [lambda: SGD(lr=0.05, momentum=0.9), lambda: Adam(lr=0.01)])
@pytest.mark.parametrize("saved_on, resumed_on", [("ring", "ring"), ("ps", "ps"), ("ring", "ps"), ("ps", "ring")])
async def test_state_dict_resumes_bit_for_bit(make_groups, opt_factory, saved_on: str, resumed_on: str) -> None:
    """Checkpoint after 7 steps, resume in a new group (over ps: fresh shards that take the
    checkpoint's parameters, optimizer state and step), finish: the parameters of an
    uninterrupted run, bit for bit -- across topologies too."""
    steps, at, world = 20, 7, 3
    ref = _reference(opt_factory(), world, steps)
    groups = await make_groups(world, saved_on)
    opts = [psring.SyncSGD(g, _model(g.rank), opt_factory()) for g in groups]
    for t in range(at):
        await asyncio.gather(*(o.step(_grads(t, g.rank)) for o, g in zip(opts, groups, strict=True)))
    states = await asyncio.gather(*(o.state_dict() for o in opts))
    assert all(s["step"] == at for s in states)
    for k in ref:
        assert all(np.array_equal(s["params"][k], states[0]["params"][k]) for s in states)
    await asyncio.gather(*(g.close() for g in groups))
    groups = await make_groups(world, resumed_on)
    fresh = [psring.SyncSGD(g, _model(g.rank + 10), opt_factory()) for g in groups]  # other starting points
    for o in fresh:
        o.load_state_dict(states[0])  # rank 0's checkpoint, loaded everywhere
    await asyncio.gather(*(o.start() for o in fresh))
    assert all(o.step_count == at for o in fresh)
    for t in range(at, steps):
        outs = await asyncio.gather(*(o.step(_grads(t, g.rank)) for o, g in zip(fresh, groups, strict=True)))
    for k in ref:
        assert all(np.array_equal(out[k], ref[k]) for out in outs), k


@pytest.mark.asyncio
async def test_state_dict_refuses_another_setup_and_late_loading(make_groups) -> None:
    groups = await make_groups(2, "ring")
    opts = [psring.SyncSGD(g, _model(g.rank), SGD(lr=0.1, momentum=0.9)) for g in groups]
    states = await asyncio.gather(*(o.state_dict() for o in opts))
    other = psring.SyncSGD(groups[0], _model(0), Adam(lr=0.1))
    with pytest.raises(ValueError, match="another optimizer, compression, accumulation or parameter layout"):
        other.load_state_dict(states[0])
    with pytest.raises(RuntimeError, match="load_state_dict must come before start"):
        opts[0].load_state_dict(states[0])
    with pytest.raises(ValueError, match="not a SyncSGD checkpoint"):
        psring.SyncSGD(groups[0], _model(0), SGD(lr=0.1)).load_state_dict({"params": {}})


@pytest.mark.asyncio
async def test_syncsgd_fp16_compression_ring_ps_and_single_process_agree_bit_for_bit(make_groups) -> None:
    steps, world = 100, 3
    opt_factory = lambda: SGD(lr=0.05, momentum=0.9)  # noqa: E731
    ring = await _train(await make_groups(world, "ring"), opt_factory, steps, compression="fp16")
    ps = await _train(await make_groups(world, "ps", servers_n=2), opt_factory, steps, compression="fp16")
    ref = _reference(opt_factory(), world, steps, compression="fp16")
    plain = _reference(opt_factory(), world, steps)
    for k in ref:
        for r in range(world):
            assert np.array_equal(ring[r][k], ring[0][k]) and np.array_equal(ps[r][k], ps[0][k])
        assert np.array_equal(ring[0][k], ps[0][k]), k
        assert np.array_equal(ring[0][k], ref[k]), k
        # compression changes the bits, but only at float16's resolution
        np.testing.assert_allclose(ref[k], plain[k], rtol=0, atol=0.05)
    assert any(not np.array_equal(ref[k], plain[k]) for k in ref)


@pytest.mark.asyncio
async def test_syncsgd_compression_errors(make_groups) -> None:
    groups = await make_groups(2, "ps", servers_n=1)
    with pytest.raises(TypeError, match=r"params\['x'\].*needs float32 arrays, got float64"):
        psring.SyncSGD(groups[0], {"x": np.zeros(3)}, compression="fp16")
    with pytest.raises(ValueError, match="compression='bf8' is not one of"):
        psring.SyncSGD(groups[0], _model(0), compression="bf8")
    # a worker that compresses while the other does not: named, not silently mixed
    opts = [
        psring.SyncSGD(g, _model(0), SGD(lr=0.1), compression=c) for g, c in zip(groups, ("fp16", None), strict=True)
    ]
    t0 = time.monotonic()
    results = await asyncio.gather(
        *(o.step(_grads(0, g.rank)) for o, g in zip(opts, groups, strict=True)), return_exceptions=True
    )
    assert time.monotonic() - t0 < 5  # found at start, not at the collective timeout
    for r in results:
        assert isinstance(r, psring.MismatchError), results
        assert "rank(s) 1 set up a different optimizer, compression" in str(r)


@pytest.mark.asyncio
async def test_syncsgd_accumulate_and_argument_errors(make_groups, topology: str) -> None:
    groups = await make_groups(2, topology)
    opts = [psring.SyncSGD(g, _model(0), SGD(lr=0.1), accumulate=2) for g in groups]
    before = {k: v.copy() for k, v in opts[0].params.items()}
    mid = await asyncio.gather(*(o.step(_grads(0, g.rank)) for o, g in zip(opts, groups, strict=True)))
    assert all(np.array_equal(mid[0][k], before[k]) for k in before)  # first micro-batch: no exchange
    out = await asyncio.gather(*(o.step(_grads(1, g.rank)) for o, g in zip(opts, groups, strict=True)))
    mean = {k: sum(_grads(t, r)[k] for t in (0, 1) for r in (0, 1)) / np.float32(4) for k in before}
    for k in before:
        np.testing.assert_allclose(out[0][k], before[k] - 0.1 * mean[k], rtol=1e-5, atol=1e-6)
    with pytest.raises(KeyError, match="missing"):
        await opts[0].step({"w": _grads(0, 0)["w"]})
    with pytest.raises(ValueError, match="accumulate"):
        psring.SyncSGD(groups[0], _model(0), accumulate=0)


# ------------------------------------------------------- parameter mode
@pytest.mark.asyncio
async def test_resent_push_is_applied_exactly_once(make_groups) -> None:
    groups = await make_groups(2, "ps", servers_n=1)
    opts = [psring.SyncSGD(g, _model(0), SGD(lr=0.1, momentum=0.9)) for g in groups]
    await asyncio.gather(*(o.step(_grads(0, g.rank)) for o, g in zip(opts, groups, strict=True)))
    from psring.topology.ps.shards.paramstore import param_store

    servers = [s for s in _servers_of(groups[0])]
    store = param_store(servers[0])
    applied = store.updates_applied
    params_after_0 = {k: v.copy() for k, v in opts[0].params.items()}
    # rank 1 re-sends its step-0 push (as after a reconnect): answered, not applied again
    host = [np.concatenate([g.reshape(-1) for g in _grads(0, 1).values()])]
    out = [np.empty_like(host[0])]
    await groups[1].params.step(0, host, out)
    assert store.updates_applied == applied
    flat0 = np.concatenate([v.reshape(-1) for v in params_after_0.values()])
    assert np.array_equal(out[0], flat0)


def _servers_of(group):
    import gc
    import warnings

    from psring.topology.ps.shards.shard import Shard

    with warnings.catch_warnings():  # isinstance() on some modules' lazy attributes warns (torch)
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, Shard) and o.job == group.links.settings.job]


SERVER_ARGS = ["--shards", "2", "--host", "127.0.0.1", "--checkpoint-every", "1"]


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_server_sigkilled_and_restored_ends_with_uninterrupted_parameters(store, tmp_path) -> None:
    job = "ckpt"
    args = [*SERVER_ARGS, "--store", f"127.0.0.1:{store.port}", "--job", job, "--checkpoint-dir", str(tmp_path)]
    server, _ = await spawn_server(args)
    groups = []
    try:
        groups = await ps_workers(store.port, job, 2)
        opts = [psring.SyncSGD(g, _model(g.rank), Adam(lr=0.01)) for g in groups]
        for t in range(20):
            if t == 10:  # SIGKILL the server between steps, restart it from its checkpoints
                os.kill(server.pid, signal.SIGKILL)
                end(server)
                server, line = await spawn_server([*args, "--restore"])
                assert "restored 2 bucket(s)" in line, line
            outs = await asyncio.gather(*(o.step(_grads(t, g.rank)) for o, g in zip(opts, groups, strict=True)))
        assert any(f.name.endswith(".npz") for f in tmp_path.iterdir())
        ref = _reference(Adam(lr=0.01), 2, 20)
        for k in ref:
            assert np.array_equal(outs[0][k], ref[k]) and np.array_equal(outs[1][k], ref[k]), k
    finally:
        await asyncio.gather(*(g.close() for g in groups), return_exceptions=True)
        end(server)


@pytest.mark.asyncio
async def test_elastic_admits_only_between_steps_that_exchanged(make_groups) -> None:
    """elastic with accumulate=2: a new worker starts at an exchange, so admit_waiting mid-accumulation
    raises, naming it (nothing sent); after the step that exchanged it admits (nobody waiting here)."""
    groups = await make_groups(2, "ps")
    opts = [psring.SyncSGD(g, _model(0), SGD(lr=0.1), elastic=True, accumulate=2) for g in groups]
    await asyncio.gather(*(o.start() for o in opts))
    await asyncio.gather(*(o.step(_grads(0, g.rank)) for o, g in zip(opts, groups, strict=True)))
    with pytest.raises(RuntimeError, match=r"admit_waiting in the middle of an accumulation \(1 of 2"):
        await opts[0].admit_waiting()
    await asyncio.gather(*(o.step(_grads(1, g.rank)) for o, g in zip(opts, groups, strict=True)))
    assert [o.step_count for o in opts] == [1, 1]
    assert await asyncio.gather(*(o.admit_waiting() for o in opts)) == [[], []]


@pytest.mark.asyncio
@pytest.mark.parametrize("topology", ["ps", "ring"])
async def test_elastic_local_sgd_admits_only_at_the_end_of_an_outer_step(make_groups, topology: str) -> None:
    """local_steps=2: a new worker starts from an outer step's result, so admit_waiting between outer
    steps raises, naming the inner steps taken (nothing sent); after the outer step it admits."""
    groups = await make_groups(2, topology)
    opts = [psring.SyncSGD(g, _model(0), SGD(lr=0.1), elastic=True, local_steps=2, outer=SGD(lr=1.0))
            for g in groups]  # fmt: skip
    await asyncio.gather(*(o.start() for o in opts))
    await asyncio.gather(*(o.step(_grads(0, g.rank)) for o, g in zip(opts, groups, strict=True)))
    with pytest.raises(RuntimeError, match=r"admit_waiting between outer steps \(1 of local_steps=2 inner"):
        await opts[0].admit_waiting()
    await asyncio.gather(*(o.step(_grads(1, g.rank)) for o, g in zip(opts, groups, strict=True)))
    assert [o.step_count for o in opts] == [1, 1]
    assert await asyncio.gather(*(o.admit_waiting() for o in opts)) == [[], []]
