"""Restarting a failed job: ``psring launch --max-restarts`` (torchrun's meaning) and ``psring train
--checkpoint-dir --max-restarts``, which resumes from its latest checkpoint (real processes, SIGKILL)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import pythonpath, run_tree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]

JOB = """
import os, sys, numpy as np, psring
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
g = psring.init(timeout=60)
total = g.all_reduce(np.array([g.rank + 1.0]))
print(f"ATTEMPT {attempt} RANK {g.rank} JOB {os.environ['PSRING_JOB']} SUM {total[0]:g}", flush=True)
g.close()
if g.rank == 1 and attempt < int(sys.argv[1]):
    sys.exit(3)
"""


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("PSRING_")}
    e["PYTHONPATH"] = pythonpath(ROOT)
    return e


@pytest.mark.parametrize("topology", ["ring", "ps"])
def test_launch_max_restarts_starts_every_rank_again_in_a_new_round(topology: str) -> None:
    cmd = [sys.executable, "-m", "psring", "launch", "-n", "2", "--topology", topology, "--max-restarts", "2",
           "--", sys.executable, "-c", JOB, "2"]  # fmt: skip
    res = run_tree(cmd, timeout=180, env=env())
    assert res.returncode == 0, res.stdout + res.stderr
    lines = sorted(x.split("] ", 1)[-1] for x in res.stdout.splitlines() if "ATTEMPT" in x)
    assert lines == [
        f"ATTEMPT {a} RANK {r} JOB {'default' if a == 0 else f'default.restart{a}'} SUM 3"
        for a in range(3)
        for r in range(2)
    ], res.stdout
    assert "restarting every rank (1 of 2)" in res.stderr and "restarting every rank (2 of 2)" in res.stderr


def test_launch_gives_up_after_max_restarts_with_the_failures_code() -> None:
    cmd = [sys.executable, "-m", "psring", "launch", "-n", "2", "--max-restarts", "1",
           "--", sys.executable, "-c", JOB, "5"]  # fmt: skip
    res = run_tree(cmd, timeout=180, env=env())
    assert res.returncode == 3, res.stdout + res.stderr
    assert res.stdout.count("ATTEMPT") == 4  # two attempts of two ranks
    assert "restarting every rank (1 of 1)" in res.stderr and "(2 of 1)" not in res.stderr
    cmd = [sys.executable, "-m", "psring", "launch", "-n", "1", "--max-restarts", "-1", "--", "true"]
    bad = run_tree(cmd, env=env())
    assert bad.returncode == 2 and "--max-restarts" in bad.stderr


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def train(args: list[str], kill_after_checkpoint: Path | None = None, epochs: int = 12) -> dict:  # type: ignore[type-arg]
    cmd = [sys.executable, "-m", "psring", "train", "--workers", "2", "--epochs", str(epochs), "--json", *args]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    killed = None
    try:
        if kill_after_checkpoint is not None:
            deadline = time.monotonic() + 120
            while not (kill_after_checkpoint / "checkpoint.npz").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            for child in _children(proc.pid):
                if _rank_of(child) == 1:
                    os.kill(child, signal.SIGKILL)
                    killed = child
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    assert proc.returncode == 0, out + err
    summary = json.loads(out.strip().splitlines()[-1])
    summary["killed"], summary["stderr"] = killed, err
    return summary  # type: ignore[no-any-return]


@pytest.mark.parametrize("topology, model", [("ring", "mlp"), ("ps", "mlp"), ("ring", "embed"), ("ps", "embed")])
def test_train_resumes_from_its_checkpoint_after_a_sigkilled_worker(tmp_path: Path, topology: str, model: str) -> None:
    """--model embed: the checkpoint holds its two sparse tables and their rows' optimizer state (over ps
    read from the shards): refused before ("not yet")."""
    epochs, every = (12, 5) if model == "mlp" else (2, 100)  # embed: ~940 steps an epoch
    plain = train(["--topology", topology, "--model", model], epochs=epochs)
    ck = tmp_path / "ck"
    hit = train(
        ["--topology", topology, "--model", model, "--checkpoint-dir", str(ck), "--checkpoint-every", str(every),
         "--max-restarts", "2"], ck, epochs=epochs,
    )  # fmt: skip
    assert hit["killed"] is not None and "restarting every rank (1 of 2)" in hit["stderr"], hit["stderr"]
    assert hit["resumed_at"] is not None and 0 < hit["resumed_at"] < hit["steps"], hit
    # the same data order and a checkpoint of every bit of state: the same run as if never killed
    assert hit["param_digest"] == plain["param_digest"] and hit["steps"] == plain["steps"]
    assert hit["test_accuracy"] == plain["test_accuracy"] >= (0.95 if model == "mlp" else 0.5)


@pytest.mark.parametrize(
    "local",
    [["--topology", "ring", "--local-steps", "8"], ["--topology", "ps", "--local-steps", "8"],
     ["--topology", "ring", "--compression", "powersgd:2"]],
    ids=["ring-local-sgd", "ps-local-sgd", "ring-powersgd"],
)  # fmt: skip
def test_train_with_every_ranks_own_state_resumes_from_its_checkpoint(tmp_path: Path, local: list[str]) -> None:
    """--local-steps 8 (a checkpoint every 5 outer steps) or a compressor with --checkpoint-dir: the
    checkpoint holds each rank's own state (inner optimizer, error feedback), so every rank takes part in
    making it (made by rank 0 alone, the ranks' calls differed and the job stopped on a MismatchError) and
    the file keeps its arrays (they went through JSON as strings); a resumed run ends with the
    uninterrupted run's bits."""
    plain = train(local, epochs=6)
    ck = tmp_path / "ck"
    hit = train([*local, "--checkpoint-dir", str(ck), "--checkpoint-every", "5", "--max-restarts", "2"], ck, epochs=6)
    assert hit["killed"] is not None and "restarting every rank (1 of 2)" in hit["stderr"], hit["stderr"]
    assert hit["resumed_at"] is not None and 0 < hit["resumed_at"] < hit["steps"], hit
    assert hit["param_digest"] == plain["param_digest"] and hit["steps"] == plain["steps"]
    assert hit["test_accuracy"] == plain["test_accuracy"] >= 0.9
