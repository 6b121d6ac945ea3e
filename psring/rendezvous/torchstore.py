"""Rendezvous through torch.distributed's own store, where a torch launcher already serves one.

torchrun's agent serves a c10d ``TCPStore`` on MASTER_ADDR:MASTER_PORT (or, with
``TORCHELASTIC_USE_AGENT_STORE`` not set, expects rank 0 to serve it), so psring cannot put
its own store there. Under torchrun (``TORCHELASTIC_RUN_ID`` set) psring therefore meets
through that store, created exactly as torch's own ``env://`` rendezvous creates it, and the
torch backend (``dist.init_process_group("psring")``) meets through whatever store torch
hands it. :class:`TorchStoreClient` gives such a store the interface psring's own clients
have; torch is imported only here, and only when one is used.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..errors import StoreError
from .client import StoreClient

logger = logging.getLogger(__name__)

T = TypeVar("T")


class TorchStoreClient:
    """psring's store operations on a ``torch.distributed.Store`` (TCPStore, PrefixStore, FileStore...).

    torch's calls block, so they run on a thread of this client's own, one at a time.
    """

    def __init__(self, store: Any, address: str, *, owner: bool = False) -> None:
        self._store = store
        self.address = address
        #: whether this process serves the store (torch's is_master): it must outlive the others' use
        self.owner = owner
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="psring-torch-store")

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def set(self, key: str, value: bytes | str, ttl: float | None = None) -> None:
        await self._call(self._store.set, key, value.encode() if isinstance(value, str) else bytes(value))

    async def get(self, key: str, timeout: float | None = None) -> bytes | None:
        """The value, waiting up to ``timeout`` seconds for the key to appear (None: don't wait)."""
        if timeout:
            try:
                await self._call(self._store.wait, [key], datetime.timedelta(seconds=timeout))
            except RuntimeError:  # torch's DistStoreError: not there in time
                return None
        elif not await self._call(self._store.check, [key]):
            return None
        return bytes(await self._call(self._store.get, key))

    async def get_aged(self, key: str, timeout: float | None = None) -> tuple[bytes | None, float | None]:
        return await self.get(key, timeout), None  # torch's store keeps no write times

    async def add(self, key: str, amount: int = 1) -> int:
        return int(await self._call(self._store.add, key, amount))

    async def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        # torch's compare_set: an empty expected value means "only if the key does not exist"
        current = bytes(await self._call(self._store.compare_set, key, expected or b"", desired))
        if current == desired:
            return True, desired
        return False, current if await self._call(self._store.check, [key]) else None

    async def delete(self, key: str) -> bool:
        return bool(await self._call(self._store.delete_key, key))

    async def list(self, prefix: str = "") -> list[str]:
        raise StoreError(f"torch's store at {self.address} cannot list keys (a psring cluster needs 'psring store')")

    async def wait(self, keys: Sequence[str], timeout: float) -> None:
        try:
            await self._call(self._store.wait, list(keys), datetime.timedelta(seconds=timeout))
        except RuntimeError:
            present = await self._call(self._store.check, list(keys)) if len(keys) == 1 else False
            missing = [] if present else [k for k in keys if not await self._call(self._store.check, [k])]
            raise StoreError(f"timed out after {timeout:g}s waiting for store keys {missing}") from None

    barrier = StoreClient.barrier

    async def close(self) -> None:
        self._thread.shutdown(wait=False)


def torch_store(host: str, port: int, rank: int, world_size: int, timeout: float, agent_store: bool) -> Any:
    """The c10d store a torch launcher's ranks meet through, made as torch's env:// rendezvous
    makes it: a client of the agent's store, or (no agent store) served by rank 0, multi-tenant
    so that torch's own init_process_group in the same process can share it. It blocks: call it
    from a thread."""
    try:
        from torch.distributed import TCPStore
    except ImportError as exc:  # pragma: no cover - torchrun implies torch
        raise StoreError(
            f"the store at {host}:{port} is torch's (torchrun), but torch cannot be imported: {exc}"
        ) from exc
    wait = datetime.timedelta(seconds=timeout)
    if agent_store:
        return TCPStore(host, port, world_size, False, wait)
    return TCPStore(host, port, world_size, rank == 0, wait, wait_for_workers=False, multi_tenant=True)


__all__ = ["TorchStoreClient", "torch_store"]
