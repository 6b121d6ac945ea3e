"""A model's worth of memory is not made for a step's intermediates (#82: local SGD's memory): the
optimizers and the codecs work block by block, with the same bits as all at once (every one of them is
elementwise), and local SGD's inner step reads the gradients where they lie."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from psring.core.codec import CODECS
from psring.core.optim import SGD, Adam, AdamW, Optimizer
from psring.training.local import LocalModel
from psring.training.localsgd import LocalSteps

N = 1_000_003  # ~4 MB of float32, not a multiple of any block


def _peak(fn: Callable[[], Any]) -> int:
    """The bytes ``fn`` allocated at its peak beyond what it returned."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        kept = fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak - base - (kept.nbytes if isinstance(kept, np.ndarray) else 0)


@pytest.mark.parametrize(
    "make",
    [lambda: SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01), lambda: SGD(lr=0.1, weight_decay=0.1),
     lambda: Adam(lr=1e-2, weight_decay=0.1), lambda: AdamW(lr=1e-3)],
    ids=["sgd-nesterov", "sgd-wd", "adam-wd", "adamw"],
)  # fmt: skip
def test_an_update_makes_no_model_sized_intermediate_and_its_bits_are_the_halves(make: Callable[[], Optimizer]) -> None:
    opt, rng = make(), np.random.default_rng(0)
    param = rng.standard_normal(N).astype(np.float32)
    halves = [param[:400_001].copy(), param[400_001:].copy()]
    state, half_states = opt.init_state(param), [opt.init_state(h) for h in halves]
    for _ in range(3):
        grad = rng.standard_normal(N).astype(np.float32)
        assert _peak(lambda g=grad: opt.update(param, g, state)) < param.nbytes // 4  # blocks, not a model
        opt.update(halves[0], grad[:400_001], half_states[0])
        opt.update(halves[1], grad[400_001:], half_states[1])
    assert np.concatenate(halves).tobytes() == param.tobytes()
    for key in opt.state_keys():
        assert np.concatenate([s[key] for s in half_states]).tobytes() == state[key].tobytes(), key


@pytest.mark.parametrize("name", sorted(CODECS))
def test_a_codec_encodes_and_decodes_without_a_tensors_worth_of_intermediates(name: str) -> None:
    codec, rng = CODECS[name], np.random.default_rng(1)
    x = (rng.standard_normal(N) * 3).astype(np.float32)
    amax = codec.amax(x)
    assert _peak(lambda: codec.amax(x)) < x.nbytes // 4
    e = codec.scale(amax, 4)
    q = codec.encode(x, e)
    assert _peak(lambda: codec.encode(x, e)) < x.nbytes // 4
    assert _peak(lambda: codec.decode(q, e)) < x.nbytes // 4
    # the same bits as two calls on its halves (int8's scales by the offset's block)
    cut = 300_007
    assert np.concatenate([codec.encode(x[:cut], e), codec.encode(x[cut:], e, offset=cut)]).tobytes() == q.tobytes()
    y = codec.decode(q, e)
    assert np.concatenate([codec.decode(q[:cut], e), codec.decode(q[cut:], e, offset=cut)]).tobytes() == y.tobytes()


def test_local_sgds_inner_step_reads_the_gradients_in_place_with_the_buckets_bits() -> None:
    rng = np.random.default_rng(2)
    params = {"a": rng.standard_normal((300, 500)).astype(np.float32), "b": rng.standard_normal(70).astype(np.float32),
              "c": rng.standard_normal((800, 400)).astype(np.float32)}  # fmt: skip
    model = LocalModel(params, (), 1 << 20)
    assert len(model.buckets) > 1
    by_pieces, by_flats = LocalSteps(AdamW(lr=1e-2), 4), LocalSteps(AdamW(lr=1e-2), 4)
    by_pieces.begin(model.flat)
    by_flats.begin(model.flat)
    for _ in range(3):
        grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
        pieces = model.pieces(grads)
        assert all(any(np.shares_memory(p, g) for g in grads.values()) for bucket in pieces for _off, p in bucket)
        by_pieces.step(pieces)
        by_flats.step(model.flats(grads))
    for a, b, sa, sb in zip(by_pieces.local, by_flats.local, by_pieces.state, by_flats.state, strict=True):
        assert a.tobytes() == b.tobytes() and sa["step"] == sb["step"] == 3
        assert sa["exp_avg"].tobytes() == sb["exp_avg"].tobytes()
    # the pseudo-gradients are made in the local copies' memory
    pseudo = by_pieces.pseudo(model.flat)
    assert all(p is loc for p, loc in zip(pseudo, by_pieces.local, strict=True))
    assert all(np.array_equal(p, g - b) for p, g, b in zip(pseudo, model.flat, by_flats.local, strict=True))
