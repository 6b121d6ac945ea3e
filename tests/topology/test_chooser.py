"""The ring's one chooser (psring.topology.ring.chooser) alone, no sockets: which algorithm each call
takes, from the call and what the ranks agreed. The group here is data (its size, whether it is the
job's, the agreed thresholds, a same-host board's limits); the algorithms are the real classes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from psring.topology.ring.chooser import Call, Chooser
from psring.topology.ring.context import RingContext
from psring.topology.ring.parts import RingParts
from psring.topology.ring.paths import NEVER, SMALL_BYTES, Path, RingPaths

MIB = 1 << 20


class _Board:
    """A same-host board's agreed limits (psring.transport.shmboard.Board's, as every rank sees them)."""

    def __init__(self, limit: int = MIB, stream_min: int = 4 * MIB, native: bool = True) -> None:
        self.limit, self.stream_min, self.native = limit, stream_min, native

    def native_kind(self, dtype: np.dtype, op: str) -> str | None:
        return "f" if self.native and dtype == np.float32 and op in ("sum", "avg") else None

    def stream_depth(self, block: int) -> int:
        return 4


def _chooser(world_size: int = 4, gid: str = "0", board: Any = None, hosts: Any = None, **paths: Any) -> Chooser:
    net = SimpleNamespace(
        paths=RingPaths(**paths), plane=SimpleNamespace(ready=True), board=board, hosts=hosts, tcp_mesh=None
    )
    # the parts are made by the factory the group uses, on a context of data (no runtime, no sockets)
    ctx = RingContext(
        net,  # type: ignore[arg-type]
        0,
        world_size,
        list(range(world_size)),
        gid,
        runtime=None,  # type: ignore[arg-type]
        timeout=10.0,
        mailbox=None,  # type: ignore[arg-type]
        all_reduce_by=None,  # type: ignore[arg-type]
    )
    return RingParts(ctx).chooser


def _call(nbytes: int, dtype: Any = np.float32, op: str = "sum", world: bool = True, ndim: int = 1) -> Call:
    item = np.dtype(dtype).itemsize
    return Call(nbytes, nbytes // item, ndim, np.dtype(dtype), op, world)


TCP_JOB = {"rooted_min": 3, "plane_min": 8 * MIB, "two_hop_min": 32 << 10, "two_hop_max": 2 * MIB}

CASES = [
    # (what, chooser kwargs, call kwargs, route)
    ("one host, small: the boards", {"board": _Board()}, {"nbytes": 4}, Path.BOARD),
    ("one host, up to the board's limit", {"board": _Board()}, {"nbytes": MIB}, Path.BOARD),
    (
        "one host, large, native: streamed",
        {"board": _Board(), "plane_min": 8 * MIB},
        {"nbytes": 64 * MIB},
        Path.STREAMED,
    ),
    (
        "one host, large, a dtype C does not fold: the plane",
        {"board": _Board(), "plane_min": 8 * MIB},
        {"nbytes": 64 * MIB, "dtype": np.int8},
        Path.PLANE,
    ),
    ("one host, between the board and the stream: the ring", {"board": _Board()}, {"nbytes": 2 * MIB}, Path.RING),
    (
        "one host, a subgroup: no boards",
        {"board": _Board(), "gid": "1", "rooted_min": 3},
        {"nbytes": 4, "world": False},
        Path.ROOTED,
    ),
    ("between hosts, 4 B, 4 ranks: rooted", TCP_JOB, {"nbytes": 4}, Path.ROOTED),
    ("between hosts, 4 B, 2 ranks: direct", {**TCP_JOB, "world_size": 2}, {"nbytes": 4}, Path.DIRECT),
    ("between hosts, 64 KiB: two hops", TCP_JOB, {"nbytes": 64 << 10}, Path.TWO_HOP),
    ("between hosts, 1 MiB: two hops", TCP_JOB, {"nbytes": MIB}, Path.TWO_HOP),
    ("between hosts, 4 MiB: the ring", TCP_JOB, {"nbytes": 4 * MIB}, Path.RING),
    ("between hosts, 64 MiB: the plane", TCP_JOB, {"nbytes": 64 * MIB}, Path.PLANE),
    (
        "a subgroup, 64 MiB: the ring (no plane)",
        {**TCP_JOB, "gid": "2"},
        {"nbytes": 64 * MIB, "world": False},
        Path.RING,
    ),
    (
        "several ranks a host, large: two levels",
        {"hierarchical": True, "hosts": [[0, 1], [2, 3]]},
        {"nbytes": 16 * MIB},
        Path.HIERARCHICAL,
    ),
    (
        "several ranks a host, small: one hop",
        {"hierarchical": True, "hosts": [[0, 1], [2, 3]]},
        {"nbytes": SMALL_BYTES},
        Path.DIRECT,
    ),
]


@pytest.mark.parametrize(("what", "setup", "call", "route"), CASES, ids=[c[0] for c in CASES])
def test_the_chooser_names_each_calls_route(
    what: str, setup: dict[str, Any], call: dict[str, Any], route: Path
) -> None:
    setup = dict(setup)
    kw = {k: setup.pop(k) for k in ("world_size", "gid", "board", "hosts") if k in setup}
    chooser = _chooser(**kw, **setup)
    algo = chooser.choose(_call(**call))
    assert algo.route is route, what
    assert algo.eligible(_call(**call)), what  # the one it takes says it takes it


def test_every_route_has_one_algorithm_and_only_the_whole_transfer_ones_hold_the_caller() -> None:
    chooser = _chooser(board=_Board(), **TCP_JOB)
    algos = chooser.algorithms
    assert sorted(a.route.value for a in algos) == sorted(p.value for p in Path)
    assert {a.route for a in algos if a.holds_caller} == {Path.TWO_HOP, Path.PLANE}


def test_a_repeated_call_is_answered_from_its_key() -> None:
    chooser = _chooser(**TCP_JOB)
    x = np.ones(16 << 10, np.float32)
    first = chooser.algorithm(x, "sum")
    assert chooser.algorithm(x, "sum") is first and first.route is Path.TWO_HOP
    assert chooser.algorithm(np.ones(1, np.float32), "sum").route is Path.ROOTED
    assert chooser.route(_call(64 * MIB)) is Path.PLANE


def test_no_plane_no_two_hops_means_one_hop_then_the_ring() -> None:
    chooser = _chooser(rooted_min=NEVER)
    assert [chooser.route(_call(n)).value for n in (4, SMALL_BYTES, SMALL_BYTES + 4, 64 * MIB)] == [
        "direct",
        "direct",
        "ring",
        "ring",
    ]
