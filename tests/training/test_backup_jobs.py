"""Backup workers in real processes: a job with a straggler (set by the job, or for the main job by
a sitecustomize the test puts on PYTHONPATH: never by psring) keeps the same parameters on every
worker, and `psring train --backup 1` learns with a straggler."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from ..conftest import pythonpath, run_tree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("PSRING_")}
    e.update(**extra)
    return e


def test_every_worker_holds_the_same_parameters_at_every_step_with_a_straggler_left_out() -> None:
    job = str(ROOT / "tests" / "support" / "jobs" / "backup_job.py")
    code = (
        "import sys\n"
        "from psring.rendezvous.launch import launch\n"
        "from psring.transport.loop import new_event_loop\n"
        f"sys.exit(new_event_loop().run_until_complete(launch(4, [sys.executable, {job!r}], topology='ps')))\n"
    )
    env = _env(PYTHONPATH=pythonpath(ROOT), BACKUP="1", STEPS="40", SLOW_RANK="3", SLOW_S="0.005")
    res = run_tree([sys.executable, "-c", code], timeout=120, env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    rows = [json.loads(m) for m in re.findall(r"^\[rank \d+\] (\{.*\})$", res.stdout, re.M)]
    steps = [r for r in rows if "step" in r]
    seen: dict[int, float] = {}
    for r in steps:  # one parameter value per step, whoever reports it
        assert seen.setdefault(r["step"], r["w"]) == r["w"], (r, seen[r["step"]])
    # each step averaged rank 0-2's gradients (1, 2, 3: 2.0) or all four (2.5), lr 1
    for t in range(1, 41):
        if t in seen and t - 1 in seen:
            assert seen[t - 1] - seen[t] in (2.0, 2.5), (t, seen[t - 1], seen[t])
    ends = {r["rank"]: r for r in rows if "calls" in r}
    assert sorted(ends) == [0, 1, 2, 3], out
    assert len({r["final"] for r in ends.values()}) == 1 and all(r["sum"] == 4.0 for r in ends.values())
    straggler = ends[3]
    # every step is one the straggler pushed, skipped, or found done when it pulled the first parameters
    # (start(): with a backup worker the others may complete step 0 before the straggler pulls)
    assert straggler["first"] + straggler["calls"] + straggler["skipped"] == 40 and straggler["skipped"] > 0, straggler
    assert straggler["dropped"] > 0, straggler


@pytest.mark.parametrize("accumulate", ["1", "2"])
def test_the_main_job_learns_with_a_straggler_and_one_backup_worker(accumulate: str) -> None:
    """With --accumulate 2 too: a late worker skips whole steps' batches (two each), not one."""
    env = _env(
        PYTHONPATH=pythonpath(ROOT / "tests" / "support" / "straggler", ROOT),
        STRAGGLER_RANK="3",
        STRAGGLER_S="0.01",
    )
    cmd = [sys.executable, "-m", "psring", "train", "--topology", "ps", "--workers", "4", "--backup", "1",
           "--epochs", "6", "--accumulate", accumulate, "--json"]  # fmt: skip
    res = run_tree(cmd, timeout=200, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["ranks_agree"] is True, summary
    assert summary["test_accuracy"] >= 0.9, summary  # 0.95 with the default 20 epochs (docs/performance-history.md)
    assert summary["history"][-1]["step"] == 6 * summary["history"][0]["step"], summary  # every batch counted once
