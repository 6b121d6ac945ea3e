"""Who this process is in its job, from the launcher that started it.

A group's settings come from an explicit argument, then the environment, then the
defaults. The launcher names follow torch.distributed (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT); when RANK/WORLD_SIZE are unset, Slurm's (SLURM_PROCID,
SLURM_NTASKS) and a Kubernetes StatefulSet pod's ordinal are used. psring's own
variables (PSRING_*) come resolved from psring.settings.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from .. import settings as settings_mod
from ..settings import Settings
from .client import StoreAddress, parse_store_address

TOPOLOGIES = ("ring", "ps")


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _slurm_first_host(nodelist: str) -> str:
    """First host of a Slurm node list such as 'node[03-05,07],gpu1'."""
    first = re.split(r",(?![^\[]*\])", nodelist)[0]
    match = re.match(r"^([^\[]+)\[([^\],-]+)", first)
    if match:
        return match.group(1) + match.group(2)
    return first


def resolve_rank_world(
    rank: int | None, world_size: int | None, env: Mapping[str, str]
) -> tuple[int | None, int | None]:
    if rank is None:
        rank = _int_env(env, "RANK")
    if rank is None:
        rank = _int_env(env, "SLURM_PROCID")
    if rank is None:
        rank = statefulset_ordinal(env)
    if world_size is None:
        world_size = _int_env(env, "WORLD_SIZE")
    if world_size is None:
        world_size = _int_env(env, "SLURM_NTASKS")
    return rank, world_size


def statefulset_ordinal(env: Mapping[str, str]) -> int | None:
    """A Kubernetes StatefulSet pod's ordinal (``name-3`` -> 3), only inside Kubernetes."""
    if not env.get("KUBERNETES_SERVICE_HOST"):
        return None
    hostname = env.get("HOSTNAME") or socket.gethostname()
    match = re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?-(\d+)$", hostname)
    return int(match.group(2)) if match else None


def default_store_spec(tuning: Settings, env: Mapping[str, str]) -> str | None:
    """PSRING_STORE; env:// when MASTER_* are set; else the first Slurm host; else env://."""
    if tuning.store:
        return tuning.store
    if env.get("MASTER_ADDR") or (env.get("MASTER_PORT") and not env.get("SLURM_JOB_NODELIST")):
        return "env://"
    if env.get("SLURM_JOB_NODELIST"):
        port = env.get("MASTER_PORT") or "29500"
        return f"{_slurm_first_host(env['SLURM_JOB_NODELIST'])}:{port}"
    return "env://"


def routable_host_towards(store_host: str) -> str:
    """The local address the kernel would use to reach store_host (no packet is sent)."""
    if store_host in ("127.0.0.1", "localhost", "::1", ""):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((store_host, 9))
            return sock.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


@dataclass(frozen=True)
class GroupSettings:
    topology: str
    rank: int | None
    world_size: int | None
    store: StoreAddress
    secret: bytes | None
    timeout: float
    job: str
    port: int
    bind_host: str
    advertise_host: str
    servers: int | None
    #: every PSRING_* setting of the process, resolved (psring.settings)
    tuning: Settings


def resolve_settings(
    *,
    topology: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    store: str | None = None,
    secret: str | bytes | None = None,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
) -> GroupSettings:
    """Resolve a group's settings: the arguments given, then ``env`` (default: this process's
    environment, read through psring.settings), then the defaults."""
    tuning = settings_mod.current() if env is None else settings_mod.load(env)
    env = settings_mod.scheduler_env() if env is None else env
    topology = topology or tuning.topology
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology={topology!r} is not one of {', '.join(TOPOLOGIES)}")
    rank, world_size = resolve_rank_world(rank, world_size, env)
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    if rank is not None and (rank < 0 or (world_size is not None and rank >= world_size)):
        raise ValueError(f"rank={rank} is out of range for world_size={world_size}")
    if world_size is None:
        raise ValueError("world_size is not set: pass world_size= or set WORLD_SIZE (psring launch sets it)")
    if timeout is None:
        timeout = tuning.timeout
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")
    if secret is None:
        secret = tuning.secret
    if isinstance(secret, str):
        secret = secret.encode()
    store_address = parse_store_address(store if store is not None else default_store_spec(tuning, env), env)
    advertise = tuning.advertise_host or (
        routable_host_towards(store_address.host) if store_address.scheme == "tcp" else "127.0.0.1"
    )
    bind = tuning.bind_host or ("127.0.0.1" if advertise.startswith("127.") else "0.0.0.0")
    return GroupSettings(
        topology=topology,
        rank=rank,
        world_size=world_size,
        store=store_address,
        secret=secret,
        timeout=float(timeout),
        job=tuning.job,
        port=tuning.port,
        bind_host=bind,
        advertise_host=advertise,
        servers=tuning.servers,
        tuning=tuning,
    )
