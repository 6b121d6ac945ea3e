"""``psring launch``: a local launcher in the manner of torchrun.

Starts an embedded store, spawns N processes with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT and PSRING_* set, prefixes each output line with the
rank, and if one exits non-zero ends the others (by PID) and exits non-zero too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Sequence

from .store import StoreServer, start_store


async def _pump(stream: asyncio.StreamReader, prefix: str, out: object) -> None:
    while True:
        line = await stream.readline()
        if not line:
            return
        text = line.decode(errors="replace")
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
) -> int:
    """Run cmd as n ranks; return 0 if all succeeded, else the first failing exit code."""
    if n < 1:
        raise ValueError(f"-n must be at least 1, got {n}")
    if not cmd:
        raise ValueError("nothing to launch: give a command after --")
    base = dict(os.environ if env is None else env)
    secret = base.get("PSRING_SECRET") or None
    own_store = store is None
    server = store or await start_store("127.0.0.1", 0, secret=secret.encode() if secret else None)
    procs: list[asyncio.subprocess.Process] = []
    pumps: list[asyncio.Task[None]] = []
    try:
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
            pumps.append(asyncio.ensure_future(_pump(proc.stdout, label, sys.stdout)))
        waits = {asyncio.ensure_future(p.wait()): r for r, p in enumerate(procs)}
        failed = 0
        pending = set(waits)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                code = task.result()
                if code != 0 and not failed:
                    failed = code if code > 0 else 128 - code
                    rank = waits[task]
                    sys.stderr.write(f"psring launch: rank {rank} exited with code {code}; stopping the others\n")
                    await _terminate(procs)
        await asyncio.gather(*pumps, return_exceptions=True)
        return failed
    except (Exception, asyncio.CancelledError):
        await _terminate(procs)
        raise
    finally:
        if own_store:
            await server.close()
