"""Meeting through the store: who serves it, and which rank a process gets.

Shared by both topologies (the ring's ranks and the parameter server's workers). As with
torch's TCPStore, rank 0 serves the store when none answers at MASTER_ADDR:MASTER_PORT and
that address is one of its own -- whatever form MASTER_ADDR takes (a literal, ``localhost``,
a host name, an IPv6 literal). Under torchrun the store is torch's (see ``torchstore``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ..errors import StoreError
from .client import connect_store
from .scheduler import GroupSettings
from .store import StoreServer, start_store
from .torchstore import TorchStoreClient, torch_store


def local_bind_address(host: str) -> str | None:
    """Where to serve a store that others reach as ``host``: that loopback address when it is
    one, the wildcard of its family when it is another address of this machine, None when
    ``host`` is not this machine (or does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return None
    for family, _type, _proto, _name, sockaddr in infos:
        ip = str(sockaddr[0]).split("%", 1)[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((ip, 0))  # only this machine's own addresses can be bound
            except OSError:
                continue
        if ipaddress.ip_address(ip).is_loopback:
            return ip
        return "::" if family == socket.AF_INET6 else "0.0.0.0"
    return None


@dataclass
class SetUp:
    """A group's set-up in progress: the store it meets through, the store this rank serves (if any),
    and, once made, the links layer that owns both (``owner``: closing it closes them)."""

    store: Any
    embedded: StoreServer | None
    owner: Any = None


@contextlib.asynccontextmanager
async def group_set_up(settings: GroupSettings, rank: int | None) -> AsyncIterator[SetUp]:
    """The scaffold every topology's set-up runs in: open the store (rank 0 may serve it, see
    open_store_for); if anything inside fails or is cancelled, release what was opened, once."""
    store, embedded = await open_store_for(settings, rank)
    setup = SetUp(store, embedded)
    try:
        yield setup
    except (Exception, asyncio.CancelledError):
        await release_store(setup.owner, store, embedded)
        raise


async def release_store(owner: Any, store: Any, embedded: StoreServer | None) -> None:
    """After a group's set-up failed: close the links layer that owns the store by then (``owner``,
    which closes it too), or else the store client (quietly) and the store this rank served."""
    if owner is not None:
        await owner.close()
        return
    with contextlib.suppress(Exception):  # cleanup: a close may fail any way (the peer is gone)
        await store.close()
    if embedded is not None:
        await embedded.close()


async def open_store_for(settings: GroupSettings, rank: int | None) -> tuple[Any, StoreServer | None]:
    """Connect to the store; rank 0 serves it first when none answers at its address and that
    address is this machine's (like TCPStore's is_master), unless its settings say the store is
    someone else's to serve (PSRING_STORE_SERVE=0: a worker daemon's ranks, whose store is the
    cluster's -- rank 0 serving an empty one while it restarts would split the job from it)."""
    if settings.client is not None:
        return settings.client, None
    address = settings.store
    if address.scheme == "torch":
        return await _open_torch_store(settings, rank), None
    embedded = None
    if address.scheme == "tcp" and rank == 0 and settings.config.store_serve:
        bind = local_bind_address(address.host)
        if bind is not None:
            try:
                embedded = await start_store(bind, address.port, secret=settings.secret)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise StoreError(
                        f"rank 0 cannot serve the rendezvous store on {bind}:{address.port} "
                        f"(MASTER_ADDR={address.host}): {exc}"
                    ) from exc
                # in use: someone (psring launch, psring store, a rank 0 of before) serves it
    store = await connect_store(address, secret=settings.secret, timeout=settings.timeout, role="rank")
    return store, embedded


async def connect_store_of(settings: GroupSettings) -> Any:
    """A store client for a group set up while its job runs (a ring re-formed to admit new workers,
    a new worker asking to join): the client the settings carry, else a connection of its own --
    never a store served here (the job's store runs already; a rank 0 serving an empty one would
    split the job)."""
    if settings.client is not None:
        return settings.client
    if settings.store.scheme == "torch":
        return await _open_torch_store(settings, None)
    return await connect_store(settings.store, secret=settings.secret, timeout=settings.timeout, role="rank")


async def _open_torch_store(settings: GroupSettings, rank: int | None) -> TorchStoreClient:
    address, env = settings.store, settings.launcher
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    world = int(env.get("WORLD_SIZE") or settings.world_size or 0)
    torch_rank = int(env["RANK"]) if env.get("RANK") else (rank or 0)
    try:
        store = await asyncio.to_thread(
            torch_store, address.host, address.port, torch_rank, world, settings.timeout, agent
        )
    except RuntimeError as exc:  # torch's DistStoreError / DistNetworkError
        raise StoreError(
            f"cannot reach torch's store at {address.host}:{address.port} (torchrun's rendezvous) "
            f"within {settings.timeout:g}s: {exc}"
        ) from exc
    return TorchStoreClient(store, f"torch://{address.host}:{address.port}", owner=not agent and torch_rank == 0)


async def assign_rank(store: Any, prefix: str, rank: int | None, world_size: int) -> int:
    if rank is not None:
        return rank
    assigned = await store.add(f"{prefix}/rank_counter", 1) - 1
    if assigned >= world_size:
        raise StoreError(
            f"the store assigned rank {assigned} but world_size is {world_size}: more processes joined "
            f"job {prefix!r} than expected (set PSRING_JOB to separate jobs sharing a store)"
        )
    return assigned
