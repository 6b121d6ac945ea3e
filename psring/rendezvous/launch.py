"""``psring launch``: a local launcher in the manner of torchrun.

Starts an embedded store (and, for ``--topology ps``, one ``psring server`` process
per parameter-server shard), spawns N processes with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT and PSRING_* set, prefixes each output line with the
rank, and if one exits non-zero ends the others (by PID) and exits non-zero too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Sequence

from .. import settings as settings_mod
from ..settings import Settings
from .store import StoreServer, start_store


async def _pump(
    stream: asyncio.StreamReader,
    prefix: str,
    out: object,
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
        out.write(f"{prefix}{text}" if text.endswith("\n") else f"{prefix}{text}\n")  # type: ignore[attr-defined]
        out.flush()  # type: ignore[attr-defined]


async def _terminate(procs: Sequence[asyncio.subprocess.Process], grace: float = 5.0) -> None:
    for proc in procs:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), grace)
    except TimeoutError:
        for proc in procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        await asyncio.gather(*(p.wait() for p in procs))


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
) -> int:
    """Run cmd as n ranks; return 0 if all succeeded, else the first failing exit code."""
    if n < 1:
        raise ValueError(f"-n must be at least 1, got {n}")
    if not cmd:
        raise ValueError("nothing to launch: give a command after --")
    base = settings_mod.process_env() if env is None else dict(env)
    tuning = settings_mod.load(base)  # the children's settings: bad values fail here, once
    own_store = store is None
    server = store or await start_store("127.0.0.1", 0, secret=tuning.secret_bytes)
    procs: list[asyncio.subprocess.Process] = []
    pumps: list[asyncio.Task[None]] = []
    servers: list[asyncio.subprocess.Process] = []
    try:
        if topology == "ps" and not tuning.ps_colocate:  # colocated: the ranks host the shards
            servers = await _start_local_servers(server, base, tuning, n)
            for i, proc in enumerate(servers):
                assert proc.stdout is not None
                pumps.append(
                    asyncio.ensure_future(
                        _pump(proc.stdout, f"[server {i}] " if prefix_output else "", sys.stdout, quiet_first=True)
                    )
                )
        for rank in range(n):
            child = dict(base)
            child.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(n),
                LOCAL_WORLD_SIZE=str(n),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(server.port),
                PSRING_TOPOLOGY=topology,
                PYTHONUNBUFFERED="1",
            )
            if extra_env is not None:
                child.update(extra_env[rank])
            proc = await asyncio.create_subprocess_exec(
                *cmd, env=child, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
            procs.append(proc)
            assert proc.stdout is not None
            label = f"[rank {rank}] " if prefix_output else ""
            pumps.append(asyncio.ensure_future(_pump(proc.stdout, label, sys.stdout, on_line=on_line)))
        waits = {asyncio.ensure_future(p.wait()): f"rank {r}" for r, p in enumerate(procs)}
        server_waits = {asyncio.ensure_future(p.wait()): f"server shard {i}" for i, p in enumerate(servers)}
        failed = 0
        pending = set(waits) | set(server_waits)
        while pending & set(waits):
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                code = task.result()
                who = waits.get(task) or server_waits[task]
                if (code != 0 or task in server_waits) and not failed:
                    failed = code if code > 0 else (128 - code if code < 0 else 1)
                    sys.stderr.write(f"psring launch: {who} exited with code {code}; stopping the others\n")
                    await _terminate([*procs, *servers])
        await _terminate(servers)
        for task in server_waits:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        return failed
    except (Exception, asyncio.CancelledError):
        await _terminate([*procs, *servers])
        raise
    finally:
        if own_store:
            await server.close()


async def _start_local_servers(
    store: StoreServer, env: dict[str, str], tuning: Settings, workers: int
) -> list[asyncio.subprocess.Process]:
    """The parameter-server shards of a local ps job: one ``psring server`` process per shard.

    PSRING_SERVERS of them (default: one per worker); PSRING_CHECKPOINT_DIR, when set,
    is passed on as --checkpoint-dir.
    """
    count = tuning.servers or workers
    if count < 1:
        raise ValueError(f"--servers must be at least 1, got {count}")
    procs = []
    for i in range(count):
        cmd = [
            sys.executable,
            "-m",
            "psring",
            "server",
            "--store",
            f"127.0.0.1:{store.port}",
            "--shard",
            str(i),
            "--num-shards",
            str(count),
            "--host",
            "127.0.0.1",
            "--job",
            tuning.job,
        ]
        if tuning.checkpoint_dir:
            cmd += ["--checkpoint-dir", tuning.checkpoint_dir]
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            env={**env, "PYTHONUNBUFFERED": "1"},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        procs.append(proc)
    return procs
