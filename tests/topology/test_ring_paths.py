"""The ring's path decision alone: a pure function of the call and the agreed thresholds (ring.paths)."""

from __future__ import annotations

import pytest

from psring.topology.ring.paths import NEVER, SMALL_BYTES, Path, RingPaths, choose_all_reduce, choose_reduce, describe

KIB, MIB = 1 << 10, 1 << 20
DEFAULT = RingPaths(rooted_min=3, plane_min=8 * MIB)


@pytest.mark.parametrize(
    ("nbytes", "n_ranks", "paths", "kw", "expected"),
    [
        (4, 2, DEFAULT, {}, Path.DIRECT),  # below the rooted threshold
        (4, 4, DEFAULT, {}, Path.ROOTED),
        (SMALL_BYTES, 4, DEFAULT, {}, Path.ROOTED),  # the bound is inclusive
        (SMALL_BYTES + 1, 4, DEFAULT, {}, Path.RING),
        (8 * MIB - 1, 4, DEFAULT, {}, Path.RING),
        (8 * MIB, 4, DEFAULT, {}, Path.PLANE),
        (8 * MIB, 4, DEFAULT, {"world": False}, Path.RING),  # subgroups have no plane
        (8 * MIB, 4, DEFAULT, {"plane_up": False}, Path.RING),
        (8 * MIB, 4, DEFAULT, {"coded": True}, Path.RING),  # a codec never takes the plane
        (4, 4, DEFAULT, {"coded": True}, Path.ROOTED),
        (64 * MIB, 1, DEFAULT, {}, Path.DIRECT),  # one rank: nothing to pipeline
        (64 * MIB, 4, RingPaths(rooted_min=3, hierarchical=True), {}, Path.HIERARCHICAL),
        (4, 4, RingPaths(rooted_min=3, hierarchical=True), {}, Path.ROOTED),  # small: one hop, two-level fold
        (64 * MIB, 4, RingPaths(rooted_min=3, hierarchical=True), {"world": False}, Path.RING),
        (4, 8, RingPaths(), {}, Path.DIRECT),  # PSRING_RING_ROOTED_MIN=0: never rooted
        # a plane threshold below the one-hop bound wins over it, on every rank alike
        (1 * KIB, 4, RingPaths(rooted_min=3, plane_min=1 * KIB), {}, Path.PLANE),
    ],
)
def test_choose_all_reduce(nbytes: int, n_ranks: int, paths: RingPaths, kw: dict, expected: Path) -> None:
    assert choose_all_reduce(nbytes, n_ranks, paths, **kw) is expected


def test_choose_reduce() -> None:
    assert choose_reduce(4, 4, DEFAULT, to_all=True) is Path.ROOTED  # reduce_scatter
    assert choose_reduce(4, 4, DEFAULT, to_all=False) is Path.DIRECT  # reduce to one rank
    assert choose_reduce(SMALL_BYTES + 1, 4, DEFAULT, to_all=True) is Path.RING
    assert choose_reduce(64 * MIB, 4, DEFAULT, to_all=False) is Path.RING  # never the plane


def test_describe_names_the_thresholds() -> None:
    text = "\n".join(describe(DEFAULT))
    assert "from 3 ranks" in text and f"from {8 * MIB} bytes" in text
    assert "off" in "\n".join(describe(RingPaths(plane_min=NEVER)))
