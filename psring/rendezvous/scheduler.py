"""Who this process is in its job, from the launcher that started it.

A group's settings come from an explicit argument, then the environment, then the
defaults. The launcher names follow torch.distributed (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT); when RANK/WORLD_SIZE are unset, Slurm's (SLURM_PROCID,
SLURM_NTASKS), a Kubernetes Indexed Job's completion index and a StatefulSet pod's
ordinal are used. psring's own variables (PSRING_*) come resolved from psring.settings.
"""

from __future__ import annotations

import fcntl
import ipaddress
import re
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import settings as settings_mod
from ..settings import TOPOLOGY_NAMES, Settings
from .client import StoreAddress, parse_store_address


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
    """Rank and world size: the arguments, else RANK/WORLD_SIZE (torchrun, psring launch, Kubeflow's
    PyTorchJob), else Slurm's SLURM_PROCID/SLURM_NTASKS, else a Kubernetes Indexed Job's
    JOB_COMPLETION_INDEX or StatefulSet pod ordinal (world size then from WORLD_SIZE)."""
    for name in ("RANK", "SLURM_PROCID", "JOB_COMPLETION_INDEX"):
        if rank is None:
            rank = _int_env(env, name)
    if rank is None:
        rank = statefulset_ordinal(env)
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        if world_size is None:
            world_size = _int_env(env, name)
    return rank, world_size


def statefulset_ordinal(env: Mapping[str, str]) -> int | None:
    """A Kubernetes StatefulSet pod's ordinal (``name-3`` -> 3), only inside Kubernetes."""
    if not env.get("KUBERNETES_SERVICE_HOST"):
        return None
    hostname = env.get("HOSTNAME") or socket.gethostname()
    match = re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?-(\d+)$", hostname)
    return int(match.group(2)) if match else None


def slurm_port(env: Mapping[str, str]) -> int:
    """MASTER_PORT, else a port derived from the Slurm job id (two jobs sharing a node then
    meet on different ports), else 29500."""
    port = _int_env(env, "MASTER_PORT")
    if port is not None:
        return port
    job = _int_env(env, "SLURM_JOB_ID")
    return 20000 + job % 20000 if job is not None else 29500


def default_store_spec(config: Settings, env: Mapping[str, str]) -> str | None:
    """Where the ranks meet, unless told: PSRING_STORE; under torchrun torch's own store at
    MASTER_ADDR:MASTER_PORT; env:// when MASTER_* are set; else the first host of a Slurm
    allocation; else env:// (which then says what is missing)."""
    if config.store:
        return config.store
    if env.get("TORCHELASTIC_RUN_ID") and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"torch://{_bracketed(env['MASTER_ADDR'])}:{env['MASTER_PORT']}"
    if env.get("MASTER_ADDR") or (env.get("MASTER_PORT") and not env.get("SLURM_JOB_NODELIST")):
        return "env://"
    if env.get("SLURM_JOB_NODELIST"):
        return f"{_bracketed(_slurm_first_host(env['SLURM_JOB_NODELIST']))}:{slurm_port(env)}"
    return "env://"


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def routable_host_towards(store_host: str) -> str:
    """The local address the kernel would use to reach store_host (no packet is sent): loopback
    for a store on loopback, else the address of the interface that routes there."""
    try:
        infos = socket.getaddrinfo(store_host or "127.0.0.1", 9, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError):
        infos = []
    for family, _type, _proto, _name, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect(sockaddr)
                return str(sock.getsockname()[0])
        except OSError:
            continue
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def default_route_host() -> str:
    """This host's address for others (a file store has no host to route towards): the one on
    its default route, else the first address of an interface that is up and not loopback,
    else 127.0.0.1."""
    for probe in ("192.0.2.1", "2001:db8::1"):  # documentation addresses: nothing is sent
        address = routable_host_towards(probe)
        if address and not address.startswith("127.") and address != "::1":
            return address
    return next(iter(interface_addresses()), "127.0.0.1")


def interface_addresses() -> list[str]:
    """The IPv4 addresses of this host's interfaces other than loopback (Linux)."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _index, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address on it
            address = socket.inet_ntoa(raw[20:24])
            if not address.startswith("127."):
                found.append(address)
    return found


def bind_host_for(advertise: str) -> str:
    """Loopback when advertising loopback, else the wildcard of the advertised address's family."""
    try:
        ip = ipaddress.ip_address(advertise.strip("[]"))
    except ValueError:
        return "0.0.0.0"
    if ip.is_loopback:
        return str(ip)
    return "::" if ip.version == 6 else "0.0.0.0"


@dataclass(frozen=True)
class GroupSettings:
    """What one group is set up with: who it is, where it meets, and ``config``, the one place for
    every setting (the PSRING_* variables with this group's explicit arguments applied)."""

    rank: int | None
    world_size: int | None
    store: StoreAddress
    #: the address ranks and servers bind, and the one others reach this process at (resolved)
    bind_host: str
    advertise_host: str
    #: every PSRING_* setting, with the group's own arguments (topology, timeout, secret) applied
    config: Settings
    #: the launcher's variables this was resolved from (RANK, MASTER_ADDR, TORCHELASTIC_*, SLURM_*, ...)
    launcher: Mapping[str, str] = field(default_factory=dict)
    #: an open store client to meet through instead of connecting to ``store`` (torch's backend
    #: hands its c10d store this way); ``store`` then only says where the ranks route to
    client: Any = None

    # the settings a group reads most, by their short names (each lives in ``config`` only)
    @property
    def topology(self) -> str:
        return self.config.topology

    @property
    def timeout(self) -> float:
        return self.config.timeout

    @property
    def secret(self) -> bytes | None:
        return self.config.secret_bytes

    @property
    def job(self) -> str:
        return self.config.job

    @property
    def port(self) -> int:
        return self.config.port

    @property
    def servers(self) -> int | None:
        return self.config.servers


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
    config = settings_mod.current() if env is None else settings_mod.load(env)
    env = settings_mod.scheduler_env() if env is None else env
    topology = topology or config.topology
    if topology not in TOPOLOGY_NAMES:
        raise ValueError(f"topology={topology!r} is not one of {', '.join(TOPOLOGY_NAMES)}")
    rank, world_size = resolve_rank_world(rank, world_size, env)
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    if rank is not None and (rank < 0 or (world_size is not None and rank >= world_size)):
        raise ValueError(f"rank={rank} is out of range for world_size={world_size}")
    if world_size is None:
        raise ValueError("world_size is not set: pass world_size= or set WORLD_SIZE (psring launch sets it)")
    if timeout is None:
        timeout = config.timeout
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")
    if isinstance(secret, bytes):  # kept as text in config; any bytes survive the round trip
        secret = secret.decode("utf-8", "surrogateescape")
    if secret is not None:
        config = config.replace(secret=secret)
    config = config.replace(topology=topology, timeout=float(timeout))
    store_address = parse_store_address(store if store is not None else default_store_spec(config, env), env)
    if config.advertise_host:
        advertise = config.advertise_host
    elif store_address.scheme == "file":  # the ranks may be on several hosts sharing the directory
        advertise = default_route_host()
    else:
        advertise = routable_host_towards(store_address.host)
    bind = config.bind_host or bind_host_for(advertise)
    return GroupSettings(
        rank=rank,
        world_size=world_size,
        store=store_address,
        bind_host=bind,
        advertise_host=advertise,
        config=config,
        launcher=dict(env),
    )
