"""Every SyncSGD option with every other, on both topologies (#61), generated from docs/api.md's table.

The table (between ``<!-- option-matrix -->`` markers) says, for each option alone and each pair, which
topologies take it. Each cell runs on both: where the table marks the topology, two workers learn
(every rank the same bits, the parameters moved) and, where the contract says, the bits equal another
run's -- ring and ps alike, elastic with no failure the non-elastic run's, a checkpoint's resume the
uninterrupted run's; anywhere else ``SyncSGD(...)`` raises ValueError at once, naming the option it
refuses. The docs and the code cannot drift apart: a cell changed in either fails here.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import psring
from psring.optim import SGD

pytestmark = pytest.mark.timeout(120)

OPTIONS = ["sparse", "compression", "accumulate", "elastic", "backup", "checkpoint"]
ROWS, WIDTH = 30, 4
DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _table() -> dict[frozenset[str], set[str]]:
    """The documented matrix: option set (one or two) -> the topologies that take it."""
    text = DOCS.read_text()
    body = text.split("<!-- option-matrix -->", 1)[1].split("<!-- /option-matrix -->", 1)[0]
    rows = [line for line in body.strip().splitlines() if line.startswith("| **")]
    header = [c.strip() for c in body.strip().splitlines()[0].strip("|").split("|")][1:]
    assert header == OPTIONS, header
    out: dict[frozenset[str], set[str]] = {}
    for line in rows:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = re.fullmatch(r"\*\*(\w+)\*\*", cells[0])
        assert name is not None, line
        i = OPTIONS.index(name.group(1))
        for j, cell in enumerate(cells[1:]):
            if j < i:
                assert cell == "", f"{line}: the table is upper-triangular"
                continue
            takes = {t.strip() for t in cell.split(",")} - {"--", ""}
            assert takes <= {"ring", "ps"}, line
            out[frozenset({OPTIONS[i], OPTIONS[j]})] = takes
    return out


TABLE = _table()
#: a cell with compression runs with every codec (psring.core.codec)
CODECS = ["fp16", "bf16", "int8"]
CELLS = [
    (cell, topology, codec)
    for cell in TABLE
    for topology in ("ring", "ps")
    for codec in (CODECS if "compression" in cell else [None])
]


def _id(cell: frozenset[str], topology: str, codec: str | None = None) -> str:
    return "+".join(o if o != "compression" or codec is None else codec for o in OPTIONS if o in cell) + f"-{topology}"


def _params(sparse: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    out = {"w": rng.standard_normal(40).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
    if sparse:
        out["emb"] = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
    return out


def _grads(call: int, rank: int, sparse: bool) -> dict[str, Any]:
    rng = np.random.default_rng(1000 * call + rank)
    out: dict[str, Any] = {
        "w": rng.standard_normal(40).astype(np.float32),
        "b": rng.standard_normal(3).astype(np.float32),
    }
    if sparse:
        idx = rng.integers(0, ROWS, 5 + rank)  # duplicates happen
        out["emb"] = psring.SparseRows(idx, rng.standard_normal((idx.size, WIDTH)).astype(np.float32), ROWS)
    return out


def _kwargs(options: frozenset[str], codec: str | None = None) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    if "sparse" in options:
        kw["sparse"] = ["emb"]
    if "compression" in options:
        kw["compression"] = codec or "fp16"
    if "accumulate" in options:
        kw["accumulate"] = 2
    if "elastic" in options:
        kw["elastic"] = True
    if "backup" in options:
        kw["backup"] = 1
    return kw


def _digest(state: dict[str, Any]) -> str:
    """The bits of a checkpoint: parameters, optimizer state, sparse tables and their state, step."""
    h = hashlib.sha256(str(state["step"]).encode())
    for name in sorted(state["params"]):
        h.update(np.ascontiguousarray(state["params"][name]).tobytes())
    for key, by_name in sorted(state["optimizer_state"].items()):  # {state key: {parameter: array}}
        for name in sorted(by_name):
            h.update(key.encode() + np.ascontiguousarray(by_name[name]).tobytes())
    for _name, table in sorted((state.get("tables") or {}).items()):
        h.update(np.ascontiguousarray(table["rows"]).tobytes())
        for key in sorted(table["state"]):
            h.update(np.ascontiguousarray(table["state"][key]).tobytes())
    return h.hexdigest()


async def _train(
    make_groups: Any, topology: str, options: frozenset[str], codec: str | None = None
) -> tuple[str, bool]:
    """Two workers, 4 optimizer steps (a checkpoint: 2, saved, then 2 more on a new job that loads it).
    Returns (the bits every rank agrees on, whether the dense parameters moved)."""
    sparse = "sparse" in options
    kw = _kwargs(options, codec)
    calls = 4 * kw.get("accumulate", 1)
    cut = calls // 2 if "checkpoint" in options else calls
    groups = await make_groups(2, topology)
    opts = [psring.SyncSGD(g, _params(sparse), SGD(lr=0.05, momentum=0.9), **kw) for g in groups]
    await asyncio.gather(*(o.start() for o in opts))
    for call in range(cut):
        await asyncio.gather(*(o.step(_grads(call, g.rank, sparse)) for o, g in zip(opts, groups, strict=True)))
    states = await asyncio.gather(*(o.state_dict() for o in opts))
    if cut < calls:  # resumed from rank 0's checkpoint by a new job (new groups; over ps new shards)
        groups = await make_groups(2, topology)
        opts = [psring.SyncSGD(g, _params(sparse), SGD(lr=0.05, momentum=0.9), **kw) for g in groups]
        for o in opts:
            o.load_state_dict(states[0])
        await asyncio.gather(*(o.start() for o in opts))
        for call in range(cut, calls):
            await asyncio.gather(*(o.step(_grads(call, g.rank, sparse)) for o, g in zip(opts, groups, strict=True)))
        states = await asyncio.gather(*(o.state_dict() for o in opts))
    digests = {_digest(s) for s in states}
    assert len(digests) == 1, f"the ranks hold different bits: {digests}"
    moved = not np.array_equal(states[0]["params"]["w"], _params(sparse)["w"])
    return digests.pop(), moved


_bits: dict[tuple[str, frozenset[str], str | None], str] = {}


async def _bits_of(make_groups: Any, topology: str, options: frozenset[str], codec: str | None) -> str:
    codec = codec if "compression" in options else None
    key = (topology, options, codec)
    if key not in _bits:
        _bits[key] = (await _train(make_groups, topology, options, codec))[0]
    return _bits[key]


@pytest.mark.asyncio
@pytest.mark.parametrize(("cell", "topology", "codec"), CELLS, ids=[_id(*c) for c in CELLS])
async def test_every_option_with_every_other(
    make_groups: Any, cell: frozenset[str], topology: str, codec: str | None
) -> None:
    if topology not in TABLE[cell]:
        groups = await make_groups(2, topology)
        with pytest.raises(ValueError) as refused:
            psring.SyncSGD(groups[0], _params("sparse" in cell), SGD(lr=0.05, momentum=0.9), **_kwargs(cell, codec))
        message = str(refused.value)
        assert any(option in message for option in cell), f"{_id(cell, topology, codec)}: {message}"
        return
    bits, moved = await _train(make_groups, topology, cell, codec)
    _bits[(topology, cell, codec)] = bits
    assert moved, f"{_id(cell, topology, codec)}: the parameters did not move"
    if "backup" in cell:  # which pushes a step takes depends on timing: agreement is the contract
        return
    if "checkpoint" in cell:  # a resume gives the uninterrupted run's bits
        assert bits == await _bits_of(make_groups, topology, cell - {"checkpoint"} or frozenset({"plain"}), codec)
    if "elastic" in cell:  # with no failure: the non-elastic run's bits
        assert bits == await _bits_of(make_groups, topology, cell - {"elastic"} or frozenset({"plain"}), codec)
    elif "ring" in TABLE[cell] and "ps" in TABLE[cell]:  # one contract, both topologies: the same bits
        other = "ps" if topology == "ring" else "ring"
        assert bits == await _bits_of(make_groups, other, cell, codec)


def test_the_table_covers_every_option_and_pair() -> None:
    want = {frozenset(p) for p in itertools.combinations_with_replacement(OPTIONS, 2)}
    assert set(TABLE) == want
