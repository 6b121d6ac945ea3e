"""Settings are honoured everywhere they apply: no keyword default or flag shadows a PSRING_* variable.

A parameter named like a setting defaults to ``None`` ("the setting"); a flag that names a variable in
its help defaults to that variable's value; a bad value is a one-line message, never a traceback.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import psring
from psring import settings as settings_mod
from psring.cli import build_parser

from .conftest import end, run_tree, spawn

pytestmark = [pytest.mark.slow]  # it starts processes

FIELDS = {f.name: f for f in settings_mod.variables()}
BY_VARIABLE = {f.metadata["env"]: f for f in settings_mod.variables()}

#: public parameters named like a setting that mean something else, and why
NOT_THE_SETTING = {
    ("Client.__init__", "timeout"): "seconds to reach the store, not a collective's deadline",
    ("start_store", "host"): "the library binds loopback unless told (PSRING_HOST is `psring store`'s)",
    ("StoreServer.start", "host"): "as start_store",
    ("start_store", "port"): "0 is PSRING_PORT's own default (any free port)",
    ("StoreServer.start", "port"): "as start_store",
}
#: flags named like a setting that mean something else, and why
FLAG_NOT_THE_SETTING = {
    "psring train --checkpoint-dir": "the main job's own checkpoints (PSRING_CHECKPOINT_DIR is where ps shards write)",
    "psring doctor --job": "picks the job to inspect (unset: the cluster); its help says what a job name is",
}


def _public_callables() -> Iterator[tuple[str, Any]]:
    for name in psring.__all__:
        obj = getattr(psring, name)
        if inspect.isclass(obj):
            yield f"{name}.__init__", obj.__init__
            for method, fn in inspect.getmembers(obj, inspect.isfunction):
                if not method.startswith("_"):
                    yield f"{name}.{method}", fn
        elif callable(obj):
            yield name, obj


def test_no_public_keyword_default_shadows_a_setting() -> None:
    shadowing = []
    for name, fn in _public_callables():
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            continue
        for p in signature.parameters.values():
            if p.name in FIELDS and p.default not in (inspect.Parameter.empty, None):
                if (name, p.name) not in NOT_THE_SETTING:
                    shadowing.append(f"{name}({p.name}={p.default!r})")
    assert not shadowing, f"defaults that shadow a PSRING_* setting (make them None = the setting): {shadowing}"


def _sample(f: Any) -> str:
    """A valid value of f's variable that differs from its default."""
    parse, default = f.metadata["parse"], f.default
    for raw in ("ps", "7.5", "7", "7K", "off", "on", "127.0.0.1:7", "sample-value"):
        try:
            value = parse(raw)
        except ValueError:
            continue
        if value != default:
            return raw
    raise AssertionError(f"no sample value for {f.metadata['env']}")


def _flags(parser: argparse.ArgumentParser, path: str = "psring") -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _flags(sub, f"{path} {name}")
        elif action.option_strings:
            yield path, action


def test_every_flag_that_names_a_variable_defaults_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PSRING_"):
            monkeypatch.delenv(name)
    named: dict[str, list[tuple[str, str]]] = {}
    unnamed = []
    for path, action in _flags(build_parser()):
        variables = re.findall(r"PSRING_[A-Z_]+", action.help or "")
        if f"{path} {action.option_strings[-1]}" in FLAG_NOT_THE_SETTING:
            continue
        if variables:
            named.setdefault(variables[0], []).append((path, action.option_strings[-1]))
        elif action.dest in FIELDS:
            unnamed.append(f"{path} {action.option_strings[-1]}")
    assert not unnamed, f"flags named like a setting whose help names no PSRING_* variable: {unnamed}"
    assert "PSRING_TIMEOUT" in named and "PSRING_SERVERS" in named and "PSRING_STORE" in named
    wrong = []
    for variable, flags in named.items():
        f = BY_VARIABLE[variable]
        raw = _sample(f)
        monkeypatch.setenv(variable, raw)
        expected = f.metadata["parse"](raw)
        for path, action in _flags(build_parser()):
            if (path, action.option_strings[-1]) in flags and action.default != expected:
                wrong.append(f"{path} {action.option_strings[-1]}: {action.default!r}, {variable}={raw!r}")
        monkeypatch.delenv(variable)
    assert not wrong, f"flags that do not default to the variable their help names: {wrong}"


def _psring(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "psring", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(60)
def test_a_bad_variable_does_not_break_import() -> None:
    bad = {**os.environ, "PSRING_TIMEOUT": "abc", "PSRING_BUFFER_POOL": "lots"}
    run = subprocess.run([sys.executable, "-c", "import psring"], env=bad, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    cli = _psring("--help", env={"PSRING_TIMEOUT": "abc"})
    assert cli.returncode == 2
    assert cli.stderr.strip() == "psring: PSRING_TIMEOUT='abc': expected a number of seconds", cli.stderr
    assert "Traceback" not in cli.stderr


JOB = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import psring

    g = psring.init()
    if g.rank == 1:
        time.sleep(float(sys.argv[1]))
    start = time.monotonic()
    try:
        g.all_reduce(np.ones(4, np.float32))
        print(f"rank {g.rank}: all_reduce returned after {time.monotonic() - start:.1f}s", flush=True)
    except psring.CollectiveTimeoutError as exc:
        print(f"rank {g.rank}: CollectiveTimeoutError after {time.monotonic() - start:.1f}s: {exc}", flush=True)
        sys.exit(3)
    finally:
        g.close()
    """
)


@pytest.mark.timeout(90)
def test_psring_timeout_is_the_deadline_of_a_launched_job(tmp_path: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text(JOB)
    start = time.monotonic()
    run = run_tree(
        [sys.executable, "-m", "psring", "launch", "-n", "2", "--", sys.executable, str(job), "8"],
        env={**os.environ, "PSRING_TIMEOUT": "1.5", "PSRING_STALL_S": "inf"},
        timeout=80,
    )
    found = re.search(r"rank 0: CollectiveTimeoutError after ([\d.]+)s", run.stdout)
    assert found, (run.returncode, run.stdout, run.stderr)
    assert float(found.group(1)) < 5.0, run.stdout
    assert run.returncode != 0
    assert time.monotonic() - start < 75


@pytest.mark.timeout(60)
def test_an_explicit_timeout_wins_over_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from psring.rendezvous.scheduler import resolve_settings

    monkeypatch.setenv("PSRING_TIMEOUT", "3")
    assert resolve_settings(world_size=1, rank=0, store="127.0.0.1:1").timeout == 3.0
    assert resolve_settings(world_size=1, rank=0, store="127.0.0.1:1", timeout=9).timeout == 9.0


@pytest.mark.timeout(60)
@pytest.mark.asyncio
async def test_bad_arguments_exit_2_and_failures_exit_1(store: psring.StoreServer) -> None:
    import asyncio

    bad = await asyncio.to_thread(_psring, "submit", "--store", f"127.0.0.1:{store.port}", "--workers", "0")
    assert bad.returncode == 2, (bad.stdout, bad.stderr)
    assert "workers=0 must be a positive integer" in bad.stdout
    # a failure while running that is also a ValueError (MismatchError, ProtocolError) is a failure: 1
    lost = await asyncio.to_thread(
        _psring, "submit", "--store", f"127.0.0.1:{store.port}", "--workers", "1", "--no-wait"
    )
    assert lost.returncode == 1, (lost.stdout, lost.stderr)


def test_a_psring_error_that_is_a_value_error_exits_1(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from psring import cli
    from psring.cli import cluster

    def mismatched(args: Any) -> int:
        raise psring.MismatchError("rank 1 called broadcast(src=0) #7, rank 0 called all_reduce(sum) #7")

    monkeypatch.setattr(cluster, "cli_status", mismatched)
    assert cli.main(["status", "--store", "127.0.0.1:1"]) == 1
    assert "rank 1 called broadcast" in capsys.readouterr().err


RANK_JOB = textwrap.dedent(
    """
    import time
    import numpy as np
    import psring

    start = time.monotonic()
    try:
        g = psring.init(topology="ring")
    except psring.MismatchError as exc:
        print(f"MismatchError at set-up: {exc}", flush=True)
        raise SystemExit(4)
    for _ in range(3):
        y = g.all_reduce(np.full(4, g.rank + 1, np.float32))
    print(f"rank {g.rank}: {y.tolist()} after {time.monotonic() - start:.1f}s", flush=True)
    g.close()
    """
)


def _ranks(store_port: int, per_rank: list[dict[str, str]]) -> list[str]:
    """Start one process per rank, each with its own PSRING_* overrides; their outputs (all ended by PID)."""
    n = len(per_rank)
    procs = [
        spawn(
            ["-c", RANK_JOB],
            {
                "RANK": str(r), "WORLD_SIZE": str(n), "PSRING_STORE": f"127.0.0.1:{store_port}",
                "PSRING_JOB": "paths", "PSRING_TIMEOUT": "20", "PSRING_STALL_S": "inf", **extra,
            },
        )
        for r, extra in enumerate(per_rank)
    ]
    try:
        for proc in procs:
            proc.wait(timeout=60)
    finally:
        outputs = [end(proc) for proc in procs]
    return outputs


@pytest.mark.timeout(90)
@pytest.mark.asyncio
async def test_ranks_with_different_rooted_thresholds_agree_on_one_path(store: psring.StoreServer) -> None:
    import asyncio

    # rank 0 would send a small all_reduce straight to everyone, ranks 1 and 2 through a root
    outputs = await asyncio.to_thread(_ranks, store.port, [{"PSRING_RING_ROOTED_MIN": "0"}, {}, {}])
    for r, out in enumerate(outputs):
        found = re.search(rf"rank {r}: \[6.0, 6.0, 6.0, 6.0\] after ([\d.]+)s", out)
        assert found, out
        assert float(found.group(1)) < 15, out  # not the 20 s timeout


@pytest.mark.timeout(90)
@pytest.mark.asyncio
async def test_a_piece_size_that_differs_is_named_at_set_up(store: psring.StoreServer) -> None:
    import asyncio

    outputs = await asyncio.to_thread(_ranks, store.port, [{}, {"PSRING_RING_PIECE": "64K"}])
    for out in outputs:
        assert re.search(
            r"MismatchError at set-up: rank \d: PSRING_RING_PIECE differs across the ranks of job 'paths': "
            r"rank \d has \d+, rank \d has \d+; set it to the same value for every rank",
            out,
        ), out


def test_child_env_writes_settings_as_their_variables_and_checks_them() -> None:
    base = {"PATH": "/bin", "PSRING_SERVERS": "3", "PSRING_JOB": "mine"}
    env = settings_mod.child_env(base, topology="ps", timeout=12.5, ps_colocate=True, servers=None, port=7000)
    assert env["PSRING_TOPOLOGY"] == "ps" and env["PSRING_TIMEOUT"] == "12.5" and env["PSRING_PS_COLOCATE"] == "1"
    assert env["PSRING_PORT"] == "7000"
    assert env["PSRING_SERVERS"] == "3" and env["PSRING_JOB"] == "mine" and env["PATH"] == "/bin"  # None: kept
    assert base == {"PATH": "/bin", "PSRING_SERVERS": "3", "PSRING_JOB": "mine"}  # the caller's mapping untouched
    resolved = settings_mod.load(env)  # what every child resolves: the values given, exactly
    assert (resolved.topology, resolved.timeout, resolved.ps_colocate, resolved.servers) == ("ps", 12.5, True, 3)
    assert settings_mod.load(settings_mod.child_env({}, timeout=float("inf"))).timeout == float("inf")
    with pytest.raises(ValueError, match=r"PSRING_TIMEOUT='-1\.0'"):
        settings_mod.child_env({}, timeout=-1.0)  # refused in the launcher, not in each child
    with pytest.raises(ValueError, match="PSRING_TOPOLOGY='mesh'"):
        settings_mod.child_env({}, topology="mesh")
    with pytest.raises(TypeError, match="no setting named 'timeout_s'"):
        settings_mod.child_env({}, timeout_s=3)
