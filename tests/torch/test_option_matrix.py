"""Every DistributedOptimizer option with every other, on both topologies (#61), generated from
docs/api.md's table (between ``<!-- torch-matrix -->`` markers), as tests/training/test_option_matrix.py
does for SyncSGD. Real processes under ``psring launch``: a cell the table marks for a topology learns
there (every rank the same bits, the parameters moved; ring and ps the same bits where both take it and
the pushes a step takes do not depend on timing, i.e. without backup workers); any other raises
ValueError at construction, naming an option it refuses."""

from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (CI installs torch==2.13.0 from disk)")

from ..conftest import run_tree

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.timeout(200)]

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "support" / "jobs" / "torch_option_matrix.py"
OPTIONS = ["compression", "passes", "sparse", "backup"]
WORDS = {"compression": "compression", "passes": "backward_passes_per_step", "sparse": "sparse_params",
         "backup": "backup"}  # fmt: skip


def _table() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "api.md").read_text()
    body = text.split("<!-- torch-matrix -->", 1)[1].split("<!-- /torch-matrix -->", 1)[0].strip().splitlines()
    header = [c.strip() for c in body[0].strip("|").split("|")][1:]
    assert header == [f"`{WORDS[o]}`" for o in OPTIONS], header
    out: dict[str, set[str]] = {}
    for line in body[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        i = [f"**`{WORDS[o]}`**" for o in OPTIONS].index(cells[0])
        for j, cell in enumerate(cells[1:]):
            if j < i:
                assert cell == "", f"{line}: the table is upper-triangular"
                continue
            name = "+".join(o for o in OPTIONS if o in {OPTIONS[i], OPTIONS[j]})
            out[name] = {t.strip() for t in cell.split(",")} - {"--", ""}
    return out


TABLE = _table()
_runs: dict[tuple[str, str], dict] = {}  # type: ignore[type-arg]


def _run(topology: str, names: list[str]) -> dict:  # type: ignore[type-arg]
    cmd = [sys.executable, "-m", "psring", "launch", "-n", "2", "--topology", topology, "--", sys.executable,
           str(JOB), ",".join(names)]  # fmt: skip
    proc = run_tree(cmd, capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = re.findall(r"^\[rank 0\] MATRIX (\{.*\})$", proc.stdout, re.M)
    assert len(found) == 1, proc.stdout[-3000:]
    return json.loads(found[0])


def _results(topology: str, name: str) -> dict:  # type: ignore[type-arg]
    """One job per topology for every cell but those that learn with backup workers; one job each for
    those (their parameters live on the job's shards)."""

    def alone(n: str) -> bool:
        return "backup" in n and topology in TABLE[n]

    if (topology, name) not in _runs:
        names = [name] if alone(name) else [n for n in TABLE if not alone(n)]
        for n, result in _run(topology, names).items():
            _runs[(topology, n)] = result
    return _runs[(topology, name)]


CELLS = [(name, topology) for name in TABLE for topology in ("ring", "ps")]


@pytest.mark.parametrize(("name", "topology"), CELLS, ids=[f"{n}-{t}" for n, t in CELLS])
def test_every_distributed_optimizer_option_with_every_other(name: str, topology: str) -> None:
    got = _results(topology, name)
    if topology not in TABLE[name]:
        assert "refused" in got, f"{name} on {topology} was not refused: {got}"
        assert any(WORDS[o] in got["refused"] for o in name.split("+")), got["refused"]
        return
    assert "refused" not in got, f"{name} on {topology}: {got['refused']}"
    assert got["agree"] and got["moved"], got
    if "backup" not in name and TABLE[name] == {"ring", "ps"}:
        other = "ps" if topology == "ring" else "ring"
        assert got["digest"] == _results(other, name)["digest"], f"{name}: ring and ps differ"


def test_the_table_covers_every_option_and_pair() -> None:
    want = {"+".join(o for o in OPTIONS if o in {a, b}) for a, b in itertools.combinations_with_replacement(OPTIONS, 2)}
    assert set(TABLE) == want
