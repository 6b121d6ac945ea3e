"""Shared fixtures: real stores and real groups on 127.0.0.1, torn down together."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio
import uvloop

import psring
from psring.rendezvous.client import connect_store, parse_store_address
from psring.rendezvous.store import StoreServer, start_store
from psring.settings import TOPOLOGY_NAMES
from psring.topology.ps.server import ShardServer, start_servers

TOPOLOGIES = list(TOPOLOGY_NAMES)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, object]:
    """Every async test runs on uvloop, as psring's entry points do."""
    return {"uvloop": uvloop.new_event_loop}


@pytest_asyncio.fixture
async def store() -> AsyncIterator[StoreServer]:
    server = await start_store("127.0.0.1", 0)
    errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
    yield server
    await server.close()
    assert not errors, f"unhandled event-loop exceptions: {errors}"


MakeGroups = Callable[..., Awaitable[list[psring.Group]]]


@pytest_asyncio.fixture
async def make_groups(store: StoreServer) -> AsyncIterator[MakeGroups]:
    """make_groups(n, topology) -> n groups of one job, all in this event loop."""
    made: list[psring.Group] = []
    servers: list[ShardServer] = []
    jobs = iter(range(10_000))

    async def make(
        n: int, topology: str = "ring", timeout: float = 20.0, servers_n: int = 2, **kw: object
    ) -> list[psring.Group]:
        job = f"t{next(jobs)}"
        os.environ["PSRING_JOB"] = job
        try:
            if topology == "ps" and not kw.get("colocate"):  # colocated: the ranks host the shards
                client = await connect_store(parse_store_address(f"127.0.0.1:{store.port}"), secret=None, timeout=10)
                servers.append(await start_servers(client, servers_n, job=job))
            groups = await asyncio.gather(
                *(
                    psring.init_group(
                        topology, rank=r, world_size=n, store=f"127.0.0.1:{store.port}", timeout=timeout, **kw
                    )
                    for r in range(n)
                )
            )
        finally:
            del os.environ["PSRING_JOB"]
        made.extend(groups)
        return list(groups)

    yield make
    await asyncio.gather(*(g.close() for g in made), return_exceptions=True)
    leftover = {(i, key): p.label for s in servers for i, sh in s.shards.items() for key, p in sh.pending.items()}
    await asyncio.gather(*(s.close() for s in servers), return_exceptions=True)
    assert not leftover, f"server shards kept state for finished collectives: {leftover}"


@pytest.fixture(params=TOPOLOGIES)
def topology(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def spawn(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start a Python subprocess running psring code (ended by the test, by PID)."""
    full = dict(os.environ)
    full["PYTHONUNBUFFERED"] = "1"
    if env:
        full.update(env)
    return subprocess.Popen(
        [sys.executable, *args], env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def run_tree(
    args: list[str], *, timeout: float = 120, capture_output: bool = True, text: bool = True, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` for a command that starts processes of its own (``psring launch``,
    ``bench``, ``train``): it runs in a session of its own, and when it is done, timed out or
    not, whatever is left of its process group is killed by the group's id (the command's PID).
    A plain ``subprocess.run`` timeout kills only the command and leaves its ranks running."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    proc = subprocess.Popen(args, text=text, start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        _kill_group(proc.pid)
        proc.communicate(timeout=30)
        raise
    finally:
        _kill_group(proc.pid)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def until(what: str, check: Any, timeout: float = 30, every: float = 0.2) -> Any:
    """Call ``check`` until it returns something truthy (returned); fail naming ``what`` past ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout}s")


def end(proc: subprocess.Popen[str]) -> str:
    """Kill a subprocess by PID if still running and return its output."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=30)
    return out or ""


async def spawn_server(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """Start ``psring server ARGS`` as a process and wait for its first line (it is registered
    then); returns the process (the test ends it, by PID) and that line."""
    proc = spawn(["-m", "psring", "server", *args], env)
    assert proc.stdout is not None
    line = await asyncio.to_thread(proc.stdout.readline)
    assert "psring server" in line, line
    return proc, line


async def ps_workers(store_port: int, job: str, n: int, timeout: float = 30) -> list[psring.Group]:
    """n ps workers of ``job`` in this event loop, against servers already registered in the store."""
    os.environ["PSRING_JOB"] = job
    try:
        return list(
            await asyncio.gather(
                *(
                    psring.init_group("ps", rank=r, world_size=n, store=f"127.0.0.1:{store_port}", timeout=timeout)
                    for r in range(n)
                )
            )
        )
    finally:
        del os.environ["PSRING_JOB"]
