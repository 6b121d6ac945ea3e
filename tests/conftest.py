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
from psring.topology.ps.shards.server import ShardServer, start_servers

TOPOLOGIES = list(TOPOLOGY_NAMES)


#: Variants that repeat what a sibling in the default run already covers, on the slow side; they run
#: with ``python -m pytest -m long`` (CI runs the default selection, README's command). Each entry
#: is a test id; one that no longer names a collected test stops the run, so the list cannot rot.
LONG_FORMS = (
    "tests/torch/test_torch_suite.py::test_a_slice_of_torchs_own_suite_passes_as_on_gloo[ps]",
    "tests/torch/test_frameworks.py::test_ray_train_trains_over_psring_like_gloo[ps]",
    "tests/torch/test_frameworks.py::test_lightning_trains_over_psring_like_gloo[ring-ddp_spawn]",
    "tests/torch/test_frameworks.py::test_lightning_trains_over_psring_like_gloo[ps-ddp]",
    "tests/topology/test_stall.py::test_every_pair_of_calls_is_named_on_every_rank[ring-medium]",
    "tests/topology/test_stall.py::test_every_pair_of_calls_is_named_on_every_rank[ring-large]",
    "tests/topology/test_stall.py::test_every_pair_of_calls_is_named_on_every_rank[ps-small]",
    "tests/topology/test_stall.py::test_every_pair_of_calls_is_named_on_every_rank[ps-medium]",
    "tests/torch/test_torch_backend.py::test_tutorial_program_prints_what_it_prints_on_gloo[train_sync_sgd.py]",
    "tests/torch/test_torch_backend.py::test_tutorial_program_prints_what_it_prints_on_gloo[allreduce_group.py]",
    "tests/torch/test_torch_backend.py::test_tutorial_program_prints_what_it_prints_on_gloo[ring_allreduce.py]",
    "tests/torch/test_torch_backend.py::test_tutorial_program_prints_what_it_prints_on_gloo[p2p_immediate.py]",
    "tests/cluster/test_cluster.py::test_a_lost_worker_daemon_restarts_the_job_from_its_checkpoint[ps-False]",
    "tests/cluster/test_store_restart.py::test_a_store_restart_mid_job_costs_nothing[ring-True]",
    "tests/topology/test_hierarchical.py::test_ring_and_ps_fold_in_the_two_level_order_across_hosts[6-block:2]",
    "tests/rendezvous/test_etcd.py::test_a_cluster_job_over_etcd_survives_a_member_lost[one member down throughout]",
    # elastic: the API-level tests run compression + accumulate on both topologies with real processes,
    # and test_cluster.py's elastic ps job runs on daemon processes (the ring's runs in containers)
    "tests/topology/test_elastic.py::test_the_main_job_loses_a_sigkilled_worker_and_finishes[ps-fp16-acc2]",
    # backup + elastic + sparse: ps-embed and ps-backup run by default, and the tables' backup rule in
    # tests/training/test_sparse_sgd.py
    "tests/topology/test_elastic.py::test_the_main_job_loses_a_sigkilled_worker_and_finishes[ps-embed-backup]",
    "tests/cluster/test_docker.py::test_an_elastic_job_goes_on_without_a_killed_worker_container[ps]",
)


@pytest.hookimpl(tryfirst=True)  # before the -m selection reads the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    by_id = {item.nodeid: item for item in items}
    picked = any("::" in str(a) for a in config.args)  # tests named one by one: their siblings may be left out
    for test_id in LONG_FORMS:
        item = by_id.get(test_id)
        if item is not None:
            item.add_marker(pytest.mark.long)
        elif not picked and any(i.startswith(test_id.split("[")[0] + "[") for i in by_id):  # siblings here, not it
            raise pytest.UsageError(f"tests/conftest.py LONG_FORMS names {test_id}, which is not a test any more")


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


def pythonpath(*dirs: object) -> str:
    """PYTHONPATH for a child: ``dirs`` first, then whatever this process was given (packages carried
    on PYTHONPATH, as on a machine without an index, must reach the children too)."""
    return os.pathsep.join([*(str(d) for d in dirs), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


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


def blocking_job_end(counters: str) -> str:
    """The end of a job script for run_blocking_job: a barrier, the ``ok`` line with ``counters`` (two
    expressions), rank DIE's silent exit, and every other rank's next call, whose error it prints."""
    return f"""g.barrier()
print("ok", {counters}, flush=True)
if os.environ.get("DIE") == str(g.rank):
    os._exit(0)  # gone without a word, as a crash
try:
    g.all_reduce(np.ones(2, np.float32))
    print("no error", flush=True)
except psring.PsringError as exc:
    print("raised", type(exc).__name__, str(exc)[:200], flush=True)
g.close()
"""


def run_blocking_job(script: Any, world: int, **env: str) -> dict[int, tuple[int, int]]:
    """Run a job script written to ``script`` on ``world`` ranks through ``psring launch`` (PSRING_TIMEOUT=20,
    so a hang fails; DIE=1: rank 1 vanishes after its ``ok A B`` line, as a crash) and return each rank's
    (A, B). Asserts every rank printed its line and every other rank's next call named rank 1's loss."""
    res = run_tree(
        [sys.executable, "-m", "psring", "launch", "-n", str(world), "--", sys.executable, str(script)],
        timeout=110,
        env={**os.environ, "PSRING_TIMEOUT": "20", "DIE": "1", **env},
    )
    out = res.stdout + res.stderr
    counts: dict[int, tuple[int, int]] = {}
    for r in range(world):
        line = next((ln for ln in out.splitlines() if ln.startswith(f"[rank {r}] ok ")), None)
        assert line is not None, out[-4000:]
        a, b = map(int, line.split()[-2:])
        counts[r] = (a, b)
    for r in range(world):
        if r != 1:
            assert f"[rank {r}] raised PeerLostError" in out and "rank 1" in out, out[-4000:]
    return counts


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
