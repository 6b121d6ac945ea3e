"""Sending one result to many workers: through one shared-memory slot where they map it, else on their sockets."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np

from ....errors import PsringError
from ....transport.connection import Connection


def release_held(held: Any) -> None:
    """Hand back the workers' shared-memory slots a piece was held in, (connection, slot) pairs
    (a connection that is gone needs nothing back)."""
    for conn, slot in held:
        if conn.is_open:
            conn.shm.release_slot(slot)


def shared_pool(conns: list[Connection], nbytes: int, shm_min: int) -> Any:
    """This process's pool, where some of conns maps it and a payload of nbytes belongs there: from
    ``shm_min`` bytes (PSRING_PS_SHM_MIN) up to a slot (a piece its workers split more coarsely than
    this process's PSRING_PS_PIECE goes on the sockets); else None."""
    if nbytes < shm_min:
        return None
    pool = next((c.shm.pool for c in conns if c.shm.peer_maps_pool), None)
    return pool if pool is not None and nbytes <= pool.slot_bytes else None


def send_once(
    conns: list[Connection],
    header: dict[str, Any],
    data: np.ndarray,
    *,
    stable: bool,
    send: Callable[[Connection, dict[str, Any], np.ndarray], None] | None = None,
    shm_min: int,
) -> None:
    """data to every conn, copied at most once: into a slot of this process's pool that the
    workers mapping it share; for the others, on their sockets -- data itself if it is
    ``stable`` (unchanged until the sockets are done with it), else one private copy.
    ``send`` sends on a socket (default: send_tensor, a lost worker ignored); payloads of
    ``shm_min`` bytes and more use the pool (PSRING_PS_SHM_MIN)."""
    pool = shared_pool(conns, data.nbytes, shm_min)
    slot = pool.take() if pool is not None else None
    if slot is None or pool is None:
        data = data if stable or not conns else data.copy()
        for conn in conns:
            if send is not None:
                send(conn, header, data)
            else:
                with contextlib.suppress(PsringError):  # a lost worker re-sends after reconnecting
                    conn.send_tensor(dict(header), data)
        return
    shared = pool.view(slot, data.nbytes).view(data.dtype)
    np.copyto(shared, data)
    try:
        for conn in conns:
            with contextlib.suppress(PsringError):  # its loss is reported through detach
                conn.shm.send_slot(header, pool, slot, shared)  # a copy for one that does not map the pool
    finally:
        pool.give_back(slot)
