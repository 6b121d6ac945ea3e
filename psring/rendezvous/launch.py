"""``psring launch``: a launcher in the manner of torchrun, one per node.

Each node's launcher starts K ranks with torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT) and PSRING_TOPOLOGY,
prefixes each output line with the rank, and, for ``--topology ps``, starts this node's
share of the parameter-server shards, one process each (``python -m psring.topology.ps SPEC``:
the shards' arguments as JSON, the secret from the environment; none with ``--colocate``: the
ranks host them).

One node: the launcher serves an embedded store on an ephemeral loopback port (or on
``--master-port``). Several nodes (``--nnodes N --node-rank i --master-addr H
--master-port P``): node 0's launcher serves the store at H:P, every launcher registers
there and waits for the others before starting its ranks, and the launchers watch one key:
when a rank fails on any node, its launcher sets it, and every launcher ends its own ranks
(by PID) within a second and exits non-zero. Node 0 keeps the store up until every node is
done.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from .. import settings as settings_mod
from ..errors import PsringError, StoreError
from ..settings import Settings
from .client import StoreAddress, connect_store
from .join import local_bind_address
from .scheduler import bind_host_for, routable_host_towards
from .store import StoreServer, start_store

#: seconds between a launcher's looks at the job's shared state (a failure elsewhere, the others done)
WATCH_S = 0.2


def _die_with_parent() -> None:
    """In a child, before it runs: SIGTERM it when the launcher dies, SIGKILLed included (Linux's
    PR_SET_PDEATHSIG), so no rank or server process outlives the launcher that owns it."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher's own SIGTERM handler still ends them
        pass


async def _pump(
    stream: asyncio.StreamReader,
    prefix: str,
    out: Any,
    quiet_first: bool = False,
    on_line: Callable[[str], bool] | None = None,
) -> None:
    while True:
        line = await stream.readline()
        if not line:
            return
        if quiet_first:  # a server's "listening on" banner
            quiet_first = False
            continue
        text = line.decode(errors="replace")
        if on_line is not None and on_line(text):
            continue
        out.write(f"{prefix}{text}" if text.endswith("\n") else f"{prefix}{text}\n")
        out.flush()


async def _terminate(procs: Sequence[asyncio.subprocess.Process], grace: float = 5.0) -> None:
    """SIGTERM, then after ``grace`` SIGKILL, every process still running; wait for them all."""
    for proc in procs:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
    try:
        async with asyncio.timeout(grace):
            await asyncio.gather(*(p.wait() for p in procs))
    except TimeoutError:
        for proc in procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        await asyncio.gather(*(p.wait() for p in procs))


def _exit_code(code: int) -> int:
    return code if code > 0 else (128 - code if code < 0 else 1)


class _Node:
    """One node's launcher: its view of the shared store, its processes, and the job's outcome."""

    def __init__(self, n: int, nnodes: int, node_rank: int, config: Settings, prefix_output: bool) -> None:
        self.n, self.nnodes, self.node_rank, self.config = n, nnodes, node_rank, config
        self.prefix_output = prefix_output
        self.base_key = f"psring-launch/{config.job}/"
        self.key = self.base_key  # this attempt's keys (a restart gets its own)
        self.store: Any = None
        self.ranks: list[asyncio.subprocess.Process] = []
        self.servers: list[asyncio.subprocess.Process] = []
        self.pumps: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------ rendezvous
    async def join(self, address: StoreAddress) -> None:
        """Register this node and wait for the others (torchrun's rendezvous, static)."""
        self.store = await connect_store(address, secret=self.config.secret_bytes, timeout=self.config.timeout)
        me = f"{socket.gethostname()} (pid {os.getpid()})"
        ok, holder = await self.store.compare_set(f"{self.base_key}node/{self.node_rank}", None, me.encode())
        if not ok:
            raise StoreError(
                f"node rank {self.node_rank} already joined this job from {(holder or b'?').decode()}: "
                "give each node's launcher its own --node-rank"
            )
        if self.nnodes > 1:
            try:
                await self.store.barrier(f"{self.key}nodes", self.nnodes, self.config.timeout)
            except StoreError:
                present = [
                    i for i in range(self.nnodes) if await self.store.get(f"{self.base_key}node/{i}") is not None
                ]
                missing = sorted(set(range(self.nnodes)) - set(present))
                raise StoreError(
                    f"node(s) {missing} of {self.nnodes} did not join at {address} within {self.config.timeout:g}s"
                ) from None

    async def next_attempt(self, attempt: int) -> None:
        """A new rendezvous round: keys of its own; every node's ranks of the last one are gone."""
        self.key = f"{self.base_key}attempt{attempt}/"
        self.ranks, self.servers, self.pumps = [], [], []
        if self.nnodes > 1:
            await self.store.barrier(f"{self.key}nodes", self.nnodes, self.config.timeout)

    async def fail(self, why: str) -> None:
        """Tell every node the job failed (the first reason wins)."""
        with contextlib.suppress(PsringError, OSError):
            await self.store.compare_set(f"{self.key}failed", None, why.encode())

    async def failed_elsewhere(self) -> str | None:
        raw = await self.store.get(f"{self.key}failed")
        return raw.decode(errors="replace") if raw is not None else None

    async def wait_for_nodes(self, timeout: float) -> None:
        """Node 0 serves the store: keep it until every node has finished (or the job failed)."""
        deadline = time.monotonic() + timeout
        keys = [f"{self.key}done/{i}" for i in range(self.nnodes)]
        while time.monotonic() < deadline:
            done = [await self.store.get(k) is not None for k in keys]
            if all(done) or await self.failed_elsewhere() is not None:
                return
            await asyncio.sleep(WATCH_S)

    # ------------------------------------------------------------ processes
    def _label(self, what: str) -> str:
        return f"[{what}] " if self.prefix_output else ""

    async def start_servers(self, address: StoreAddress, env: dict[str, str], job: str) -> None:
        """This node's share of the ps shards (shard i runs on node i % nnodes), one process each."""
        count = self.config.servers or self.n * self.nnodes
        if count < 1:
            raise ValueError(f"--servers must be at least 1, got {count}")
        advertise = self.config.advertise_host or routable_host_towards(address.host)
        for i in range(self.node_rank, count, self.nnodes):
            spec = {  # run_shards' arguments (psring.topology.ps); the rest, the secret too, from the env
                "store": str(address),
                "num_shards": count,
                "shard_ids": [i],
                "job": job,
                "host": self.config.bind_host or bind_host_for(advertise),
                "advertise": advertise,
                "checkpoint_dir": self.config.checkpoint_dir,
            }
            cmd = [sys.executable, "-m", "psring.topology.ps", json.dumps(spec)]
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                env={**env, "PYTHONUNBUFFERED": "1"},
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
            self.servers.append(proc)
            assert proc.stdout is not None
            self.pumps.append(asyncio.ensure_future(_pump(proc.stdout, self._label(f"server {i}"), sys.stdout, True)))

    async def start_ranks(
        self,
        cmd: Sequence[str],
        env: dict[str, str],
        extra_env: Sequence[dict[str, str]] | None,
        on_line: Callable[[str], bool] | None,
    ) -> None:
        for local in range(self.n):
            rank = self.node_rank * self.n + local
            child = {
                **env,
                "RANK": str(rank),
                "LOCAL_RANK": str(local),
                "WORLD_SIZE": str(self.n * self.nnodes),
                "LOCAL_WORLD_SIZE": str(self.n),
                "GROUP_RANK": str(self.node_rank),
                "PYTHONUNBUFFERED": "1",
            }
            if extra_env is not None:
                child.update(extra_env[local])
            proc = await asyncio.create_subprocess_exec(
                *cmd, env=child, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
            self.ranks.append(proc)
            assert proc.stdout is not None
            self.pumps.append(
                asyncio.ensure_future(_pump(proc.stdout, self._label(f"rank {rank}"), sys.stdout, False, on_line))
            )

    async def supervise(self, elastic: bool = False) -> int:
        """Wait for this node's ranks; end them all when one fails here or a node fails elsewhere.
        ``elastic``: a failed rank is reported and the others go on (the job decides); the result
        is the first failure's code only when no rank succeeded."""
        waits = {
            asyncio.ensure_future(p.wait()): f"rank {self.node_rank * self.n + r}" for r, p in enumerate(self.ranks)
        }
        waits.update({asyncio.ensure_future(p.wait()): f"server process {i}" for i, p in enumerate(self.servers)})
        ranks_left = set(list(waits)[: len(self.ranks)])
        failed: list[int] = []
        try:
            while ranks_left:
                done, _ = await asyncio.wait(set(waits), timeout=WATCH_S, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    code, who = task.result(), waits.pop(task)
                    ranks_left.discard(task)
                    if code != 0 and elastic and who.startswith("rank"):
                        sys.stderr.write(f"psring launch: {who} exited with code {code}; elastic: the others go on\n")
                        failed.append(code)
                        continue
                    if code != 0 or who.startswith("server"):
                        where = f" on node {self.node_rank}" if self.nnodes > 1 else ""
                        why = f"{who}{where} exited with code {code}"
                        sys.stderr.write(f"psring launch: {why}; stopping the others\n")
                        await self.fail(why)
                        return _exit_code(code)
                if self.nnodes > 1 and not done:
                    elsewhere = await self.failed_elsewhere()
                    if elsewhere is not None:
                        sys.stderr.write(f"psring launch: {elsewhere}; stopping node {self.node_rank}'s ranks\n")
                        return 1
            return _exit_code(failed[0]) if failed and len(failed) == len(self.ranks) else 0
        except (PsringError, OSError) as exc:  # the store went away: node 0's launcher is gone
            sys.stderr.write(f"psring launch: lost the job's store ({exc}); stopping node {self.node_rank}'s ranks\n")
            return 1
        finally:
            for task in waits:
                task.cancel()

    async def stop(self) -> None:
        await _terminate([*self.ranks, *self.servers])
        await asyncio.gather(*self.pumps, return_exceptions=True)


async def launch(
    n: int,
    cmd: Sequence[str],
    *,
    topology: str = "ring",
    env: dict[str, str] | None = None,
    prefix_output: bool = True,
    store: StoreServer | None = None,
    extra_env: Sequence[dict[str, str]] | None = None,
    on_line: Callable[[str], bool] | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    max_restarts: int = 0,
    elastic: bool = False,
) -> int:
    """Run cmd as this node's n ranks of an nnodes-node job; return 0 if every rank on every node
    succeeded, else the exit code of the failure (1 for a failure on another node).

    ``max_restarts`` (torchrun's meaning): when a rank fails, every rank on every node is stopped
    and the job starts again, up to that many times, in a new rendezvous round (its ranks meet as
    job ``<PSRING_JOB>.restart<k>``; TORCHELASTIC_RESTART_COUNT=k, as torchrun sets it). Resuming
    is the program's part: ``psring train --checkpoint-dir`` does it from its latest checkpoint.
    ``elastic``: a failed rank does not stop the others (an elastic ps job goes on without it)."""
    if type(max_restarts) is not int or max_restarts < 0:
        raise ValueError(f"--max-restarts must be a whole number, got {max_restarts!r}")
    if n < 1:
        raise ValueError(f"-n must be at least 1, got {n}")
    if not cmd:
        raise ValueError("nothing to launch: give a command after --")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} is not one of 0..{nnodes - 1} (--nnodes {nnodes})")
    if nnodes > 1 and (not master_addr or not master_port):
        raise ValueError("a job of several nodes needs --master-addr and --master-port (node 0's address and a port)")
    # the children's settings travel one way, as PSRING_* variables; bad values fail here, once
    base = settings_mod.child_env(settings_mod.process_env() if env is None else env, topology=topology)
    config = settings_mod.load(base)
    addr = master_addr or "127.0.0.1"
    server = store
    if server is None and node_rank == 0:
        bind = local_bind_address(addr)
        if bind is None:
            raise ValueError(
                f"--master-addr {addr} is not an address of this machine: node 0's launcher serves the store there"
            )
        server = await start_store(bind, master_port or 0, secret=config.secret_bytes)
    port = server.port if server is not None else master_port
    assert port is not None
    address = StoreAddress("tcp", host=addr, port=port)
    node = _Node(n, nnodes, node_rank, config, prefix_output)
    base.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    # SIGTERM (docker stop, a scheduler's preemption, kill): every rank and server process is ended
    # (SIGTERM, then SIGKILL after a grace) before the launcher exits, with 128 + 15 as the exit code
    loop, me = asyncio.get_running_loop(), asyncio.current_task()
    terminated: list[bool] = []

    def _on_sigterm() -> None:
        terminated.append(True)
        if me is not None:
            me.cancel()

    try:
        loop.add_signal_handler(signal.SIGTERM, _on_sigterm)
        handles_sigterm = True
    except (RuntimeError, ValueError, NotImplementedError):  # not the main thread: the caller's to handle
        handles_sigterm = False
    try:
        await node.join(address)
        attempt = 0
        while True:
            job = config.job if attempt == 0 else f"{config.job}.restart{attempt}"
            env_now = {**base, "PSRING_JOB": job}
            env_now.update(TORCHELASTIC_RESTART_COUNT=str(attempt), TORCHELASTIC_MAX_RESTARTS=str(max_restarts))
            if topology == "ps" and not config.ps_colocate:  # colocated: the ranks host the shards
                await node.start_servers(address, env_now, job)
            await node.start_ranks(cmd, env_now, extra_env, on_line)
            code = await node.supervise(elastic)
            await node.stop()
            if code == 0 or attempt >= max_restarts:
                break
            attempt += 1
            sys.stderr.write(f"psring launch: restarting every rank ({attempt} of {max_restarts})\n")
            await node.next_attempt(attempt)
        if code == 0:
            with contextlib.suppress(PsringError, OSError):
                await node.store.set(f"{node.key}done/{node_rank}", b"1")
            if node_rank == 0 and nnodes > 1:
                await node.wait_for_nodes(config.timeout)
        return code
    except (Exception, asyncio.CancelledError):
        await node.stop()
        if terminated:
            sys.stderr.write(f"psring launch: SIGTERM: stopped node {node_rank}'s ranks\n")
            return 128 + signal.SIGTERM
        raise
    finally:
        if handles_sigterm:
            loop.remove_signal_handler(signal.SIGTERM)
        if node.store is not None:
            with contextlib.suppress(Exception):  # cleanup: a close may fail any way (the peer is gone)
                await node.store.close()
        if store is None and server is not None:
            await server.close()
