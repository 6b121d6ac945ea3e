"""The dashboard's arithmetic on what the ranks report (in process): who is the straggler, and the
steps per second of a job."""

from __future__ import annotations

from psring.cluster.dashboard import _rate, _straggler


def test_the_straggler_is_the_rank_that_computes_longest_by_a_margin() -> None:
    # rank 2 computes 30 ms a step; the others 10 ms and wait ~20 ms for it in the exchange
    ranks = [
        {"rank": 0, "compute_s": 0.010, "comm_s": 0.021},
        {"rank": 1, "compute_s": 0.011, "comm_s": 0.020},
        {"rank": 2, "compute_s": 0.030, "comm_s": 0.001},
    ]
    assert [r["straggler"] for r in _straggler(ranks)] == [False, False, True]
    even = [{"rank": r, "compute_s": 0.010 + r * 0.0005, "comm_s": 0.005} for r in range(4)]
    assert not any(r["straggler"] for r in _straggler(even))  # within a fifth of a step: nobody
    assert _straggler([{"rank": 0, "compute_s": 0.5, "comm_s": 0.0}]) == [{"rank": 0, "compute_s": 0.5, "comm_s": 0.0}]


def test_steps_per_second_by_rank_zeros_clock_else_by_when_seen() -> None:
    seen = [{"step": 100 * i, "elapsed": 0.5 * i, "t": 1000.0 + i} for i in range(5)]
    assert _rate(seen) == 200.0  # rank 0's clock: 100 steps per half second
    assert _rate([{k: v for k, v in r.items() if k != "elapsed"} for r in seen]) == 100.0
    assert _rate(seen[:1]) is None and _rate([]) is None
