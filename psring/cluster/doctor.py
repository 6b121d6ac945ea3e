"""``psring doctor``: pre-flight checks of a cluster (reachability, secrets, versions, clocks, addresses)."""

from __future__ import annotations

import json
import time
from typing import Any

from ..core import wire
from ..errors import AuthError, PsringError
from ..topology.stall import format_picture
from ..transport.listener import open_connection
from ..transport.mailbox import Mailbox
from ..version import __version__
from .client import AsyncClient
from .daemons import HEARTBEAT_S, job_name

#: doctor reports a daemon whose clock is further off this one than this (heartbeat age allowed for)
CLOCK_SKEW_S = 30.0


# --------------------------------------------------------------------- doctor
async def doctor(store: str, secret: str | bytes | None = None, timeout: float = 5.0) -> list[str]:
    """Problems found (one line each, with the fix); empty when all is well."""
    problems: list[str] = []
    client = AsyncClient(store, secret, timeout)
    try:
        await client.connect()
    except AuthError as exc:
        return [f"the store at {store} rejected this secret ({exc}): set the same PSRING_SECRET everywhere"]
    except (PsringError, OSError) as exc:
        return [f"the store at {store} is unreachable ({exc}): start 'psring store' or fix --store"]
    try:
        status = await client.status()
        daemons = [("worker", r) for r in status["workers"]] + [("server", r) for r in status["servers"]]
        if not status["workers"]:
            problems.append("no worker daemon is registered: start 'psring worker --store ...' on each machine")
        hosts = {r.get("host") for _, r in daemons}
        for role, rec in daemons:
            who = f"{role} {rec.get('id')} ({rec.get('host')}:{rec.get('port')})"
            host = str(rec.get("host"))
            if host.startswith("127.0.1.") or host.startswith("172.17."):
                problems.append(
                    f"{who} advertises {host}, which other hosts cannot reach (a hosts-file or docker0 address): "
                    "set PSRING_ADVERTISE_HOST to its routable address"
                )
            elif host.startswith("127.") and any(not str(h).startswith("127.") for h in hosts):
                problems.append(f"{who} advertises loopback while others do not: set PSRING_ADVERTISE_HOST")
            if rec.get("version") != __version__ or rec.get("wire") != wire.WIRE_VERSION:
                problems.append(
                    f"{who} runs psring {rec.get('version')} (wire {rec.get('wire')}), this is {__version__} "
                    f"(wire {wire.WIRE_VERSION}): install the same version everywhere"
                )
            # a record is rewritten every heartbeat: allow for its age before blaming the clock
            skew = abs(float(rec.get("time", 0)) - time.time()) - HEARTBEAT_S * 3
            if skew > CLOCK_SKEW_S:
                problems.append(
                    f"{who}: its clock is {skew:.0f}s off this one (over {CLOCK_SKEW_S:g}s; or it stopped "
                    "heartbeating): check NTP"
                )
            if rec.get("state") == "idle":
                problems += await _probe(who, rec, client.secret, timeout)
        for rec in status["workers"]:
            for other, result in (rec.get("probes") or {}).items():
                if result != "ok":
                    problems.append(f"worker {rec['id']} cannot reach {other}: {result}")
    finally:
        await client.close()
    return problems


async def job_report(
    store: str, job: str, secret: str | bytes | None = None, timeout: float = 5.0
) -> tuple[list[str], bool]:
    """What the ranks of a job wait in, as its stall inspector last saw it: (lines, stuck).

    ``job`` is a cluster job's id (its current attempt is looked up) or any job's name (PSRING_JOB).
    The ranks write the picture when a call has waited PSRING_STALL_S (psring.topology.stall) and
    take it back when the call completes; nothing is written while nothing stalls.
    """
    client = AsyncClient(store, secret, timeout)
    try:
        await client.connect()
    except (PsringError, OSError) as exc:
        return [f"the store at {store} is unreachable or refused this client ({exc})"], True
    try:
        name = job
        if job.isdigit():
            for rec in (await client.status())["jobs"]:
                if str(rec.get("id")) == job:
                    name = job_name(int(job), int(rec.get("attempt") or 0))
                    break
        raw = await client.store.get(f"psring/{name}/stall")
    finally:
        await client.close()
    if raw is None:
        return [f"job {name}: no call has waited a stall threshold (PSRING_STALL_S): nothing is stuck"], False
    try:
        picture = json.loads(raw)
    except ValueError:
        return [f"job {name}: an unreadable stall report in the store"], True
    return [f"job {name}: " + line if i == 0 else line for i, line in enumerate(format_picture(picture))], True


async def _probe(who: str, rec: dict[str, Any], secret: bytes | None, timeout: float) -> list[str]:
    try:
        conn = await open_connection(
            str(rec.get("host")),
            int(rec.get("port") or 0),
            secret=secret,
            hello={"role": "doctor"},
            router=Mailbox(),
            timeout=timeout,
            name="doctor",
        )
    except AuthError as exc:
        return [f"{who} rejects this secret ({exc}): the secrets disagree; set the same PSRING_SECRET everywhere"]
    except (PsringError, OSError) as exc:
        return [f"{who} is unreachable on its declared port ({exc}): open the port or fix PSRING_ADVERTISE_HOST"]
    await conn.close()
    return []
