"""``init_group``: join (or form) a group over either topology.

Importing the topologies here registers them (Group.registry: "ring", "ps").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..rendezvous.scheduler import resolve_settings
from .group import Group
from .ps.worker.group import PsGroup
from .recorder import process_recorder
from .ring.group import RingGroup
from .stall import install_dump_signal

#: the topologies psring ships, by the names settings.TOPOLOGY_NAMES lists (each class registers
#: itself in Group.registry when it is defined; importing them here is what defines them)
_SHIPPED = (RingGroup, PsGroup)


# ---------------------------------------------------------------- init_group
async def init_group(
    topology: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    store: Any = None,
    secret: str | bytes | None = None,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    **options: Any,
) -> Group:
    """Join (or form) a group of ``world_size`` ranks over ``topology`` ("ring" or "ps").

    Arguments default from the environment (RANK, WORLD_SIZE, MASTER_ADDR/MASTER_PORT,
    PSRING_TOPOLOGY, PSRING_SECRET, PSRING_TIMEOUT): ``None`` always means "the setting". A rank
    that is not given one gets one from the store.
    ``store`` is an address (``host:port``, ``tcp://``, ``env://``, ``torch://``, ``file://``) or
    an open store client with an ``address`` (e.g. a TorchStoreClient over torch's c10d store).
    ``env``: resolve from this mapping of variables instead of the process's environment (a worker
    daemon runs each job's rank with that job's RANK, PSRING_JOB, ... this way).
    """
    client = None
    if store is not None and not isinstance(store, str):
        client, store = store, store.address

    settings = resolve_settings(
        topology=topology, rank=rank, world_size=world_size, store=store, secret=secret, timeout=timeout, env=env
    )
    if client is not None:
        settings = dataclasses.replace(settings, client=client)
    cls = Group.registry[settings.topology]
    group = await cls.create(settings, **options)
    if settings.config.trace_dir:
        process_recorder(settings.config.trace_dir, settings.job)
    install_dump_signal()  # SIGUSR1 prints what this process's groups wait in
    return group
