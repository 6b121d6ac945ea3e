"""A counting barrier over any store client (psring's, a file store, etcd): one implementation."""

from __future__ import annotations

from typing import Any

from ..errors import StoreError


async def store_barrier(store: Any, name: str, world_size: int, timeout: float) -> None:
    """Block until ``world_size`` callers reached the barrier ``name`` in ``store``."""
    arrived = await store.add(f"{name}/arrived", 1)
    if arrived == world_size:
        await store.set(f"{name}/done", b"1")
    if arrived > world_size:
        raise StoreError(f"barrier {name!r}: {arrived} arrivals for a world of {world_size}")
    try:
        await store.wait([f"{name}/done"], timeout)
    except StoreError:
        raise StoreError(
            f"barrier {name!r}: only {arrived if arrived < world_size else '?'} of {world_size} "
            f"arrived within {timeout:g}s"
        ) from None
