"""Meeting through the store: who embeds it, and which rank a process gets.

Shared by both topologies (the ring's ranks and the parameter server's workers).
"""

from __future__ import annotations

from typing import Any

from ..errors import StoreError
from .client import connect_store
from .scheduler import GroupSettings
from .store import StoreServer, start_store


async def open_store_for(settings: GroupSettings, rank: int | None) -> tuple[Any, StoreServer | None]:
    """Connect to the store; rank 0 on the store's own host starts it (like TCPStore's is_master)."""
    address = settings.store
    embedded = None
    if address.scheme == "tcp" and rank == 0 and address.host in ("127.0.0.1", "localhost", settings.advertise_host):
        try:
            embedded = await start_store(
                "127.0.0.1" if address.host in ("127.0.0.1", "localhost") else "0.0.0.0",
                address.port,
                secret=settings.secret,
            )
        except OSError:
            embedded = None  # someone (psring launch, psring store) already serves it
    store = await connect_store(address, secret=settings.secret, timeout=settings.timeout, role="rank")
    return store, embedded


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
