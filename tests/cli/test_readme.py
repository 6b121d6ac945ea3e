"""README's Python API blocks run as written, as a new user runs them: each saved as a file and
started with ``psring launch -n 2`` (the second over the parameter server, whose shards the launcher
starts). Real processes, a real store."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from ..conftest import pythonpath, run_tree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


def api_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Python API") : text.index("## Command line")]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def launch(tmp: Path, code: str, *args: str) -> dict[int, str]:
    script = tmp / "api.py"
    script.write_text(code)
    env = {"PYTHONPATH": pythonpath(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    res = run_tree([sys.executable, "-m", "psring", "launch", "-n", "2", *args, "--", sys.executable, str(script)],
                   timeout=180, env=env, cwd=str(tmp))  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = {}
    for line in res.stdout.splitlines():
        m = re.match(r"\[rank (\d)\] (\d) (.*)$", line)
        if m:
            assert m.group(1) == m.group(2), line  # the rank the launcher named printed its own rank
            lines[int(m.group(1))] = m.group(3)
    return lines


def test_the_readme_has_two_api_blocks() -> None:
    blocks = api_blocks()
    assert len(blocks) == 2 and "init_group" in blocks[0] and "psring.init(" in blocks[1]


def test_the_async_api_block_runs_as_written(tmp_path: Path) -> None:
    got = launch(tmp_path, api_blocks()[0])
    # the fp16 average of 1 and 2 broadcast from rank 0, and one SGD step of the mean gradient 0.5
    assert got == {0: "[1.5 1.5 1.5 1.5] [-0.05 -0.05]", 1: "[1.5 1.5 1.5 1.5] [-0.05 -0.05]"}, got


def test_the_blocking_api_block_runs_as_written_over_ps(tmp_path: Path) -> None:
    got = launch(tmp_path, api_blocks()[1], "--topology", "ps")
    assert got == {0: "[0. 2. 4. 6.]", 1: "[0. 2. 4. 6.]"}, got
