"""Setting up a parameter-server group: a rank's shards started where they live, the links to every
shard, the wire's piece agreed, and the host reduce where several ranks share a host; or a new worker
joining a running elastic job (``init_group(topology="ps", join=True)``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from ....errors import PsringError, StoreError
from ....rendezvous.join import assign_rank, group_set_up
from ....rendezvous.scheduler import GroupSettings
from ..shards.server import start_servers
from . import hostreduce
from .admission import joins_closed, joins_closed_key
from .hostreduce import HostReduce
from .links import ServerLinks
from .view import WorkerGroup

logger = logging.getLogger(__name__)

G = TypeVar("G", bound=WorkerGroup)
#: how set-up makes the group: (links, rank, world_size, members, gid, timeout) -> the group (PsGroup)
Make = Callable[[ServerLinks, int, int, list[int], str, float], G]


async def create(cls: Make[G], settings: GroupSettings, **options: Any) -> G:
    servers = options.pop("servers", None)
    colocate = options.pop("colocate", None)
    join = options.pop("join", False)
    if join:
        return await join_running(cls, settings, options)
    if colocate is None:
        colocate = settings.config.ps_colocate
    elif not isinstance(colocate, bool):
        raise TypeError(f"colocate={colocate!r} must be True or False")
    if options:
        raise TypeError(f"init_group(topology='ps') got unexpected options {sorted(options)}")
    if servers is not None and (type(servers) is not int or servers < 1):
        raise ValueError(f"servers={servers!r} must be a positive number of shards")
    assert settings.world_size is not None
    world = settings.world_size
    dedicated = settings.config.ps_dedicated
    if dedicated and not colocate:
        raise ValueError(
            f"PSRING_PS_DEDICATED={dedicated} adds dedicated shards to colocated ones: it needs "
            f"PSRING_PS_COLOCATE=1 (without it every shard is a psring server already)"
        )
    prefix = f"psring/{settings.job}"
    async with group_set_up(settings, settings.rank) as setup:
        store, embedded = setup.store, setup.embedded
        rank = await assign_rank(store, prefix, settings.rank, world)
        links = setup.owner = ServerLinks(rank, world, settings, store, prefix)
        links.embedded_store = embedded
        # a colocated shard dies with its rank and never comes back: no waiting to re-send to it
        links.colocated = colocate
        links.reconnect_servers = not colocate
        hosted: list[int] | None = None  # the shards this process starts (None: none)
        if colocate:  # every rank hosts its share of the shards (i % world == rank) in its own process
            # ... but the last PSRING_PS_DEDICATED ids, which psring servers on other hosts serve
            colocated = servers or settings.servers or world
            count = colocated + dedicated
            hosted = [i for i in range(colocated) if i % world == rank] or None
        elif rank == 0 and (
            servers is not None or embedded is not None or settings.store.scheme == "torch" or settings.client
        ):
            # asked to, or nobody else can have started servers (this process serves the store,
            # or the store is torch's: torchrun and init_process_group start only the ranks): every shard here
            count = servers or settings.servers or 1
            hosted = list(range(count))
        if hosted is not None:
            links.own_servers = await start_servers(
                store,
                count,
                job=settings.job,
                secret=settings.secret,
                host=settings.bind_host,
                port=settings.port,  # a worker listens on nothing else: its shards take its port
                advertise=settings.advertise_host,
                shard_ids=hosted,
                settings=settings.config,
            )
        await links.resolve(settings.timeout)
        await links.connect(settings.timeout)
        group = cls(links, rank, world, list(range(world)), "0", settings.timeout)
        await links.tell_piece(f"{prefix}/wire")
        board = await hostreduce.offer(store, prefix, rank, settings.config)
        try:
            await store.barrier(f"{prefix}/ready", world, settings.timeout)
        except BaseException:
            if board is not None:
                board.close()
            raise
        try:
            await links.learn_piece(f"{prefix}/wire")
            agreed = await hostreduce.agree(store, prefix, rank, world, board, settings.timeout)
        except (ValueError, PsringError):  # e.g. rank 0's PSRING_PS_WEIGHTS does not fit the shards
            if board is not None:
                board.close()
            await group.close()
            raise
        if agreed is not None:
            assert board is not None
            group.host_reduce = links.host_reduce = HostReduce(group, board, *agreed)
        logger.info("%r ready with %d server shard(s)", group, len(links.shards))
        return group

async def join_running(cls: Make[G], settings: GroupSettings, options: dict[str, Any]) -> G:
    """A new worker for a running elastic job (SyncSGD(elastic=True)): it takes the next free
    rank past the job's world size and waits in SyncSGD.start until a boundary admits it."""
    if options:
        raise TypeError(f"init_group(topology='ps', join=True) got unexpected options {sorted(options)}")
    if settings.rank is not None:
        raise ValueError("join=True takes its rank from the store: leave RANK unset (rank= None)")
    assert settings.world_size is not None
    prefix = f"psring/{settings.job}"
    async with group_set_up(settings, None) as setup:
        store = setup.store
        if await store.get(f"{prefix}/elastic", settings.timeout) is None:
            raise StoreError(
                f"job {settings.job!r} at {store.address} runs no elastic SyncSGD (SyncSGD(elastic=True) on ps "
                f"marks it) within {settings.timeout:g}s: nothing to join"
            )
        closed = await store.get(joins_closed_key(prefix))
        if closed is not None:
            raise PsringError(f"job {settings.job!r} at {store.address} {joins_closed(closed)}: nothing to join")
        rank = settings.world_size + await store.add(f"{prefix}/joiners", 1) - 1
        links = setup.owner = ServerLinks(rank, settings.world_size, settings, store, prefix)  # not a member
        links.reconnect_servers = True
        await links.resolve(settings.timeout)
        await links.connect(settings.timeout)
        await links.learn_piece(f"{prefix}/wire")
        group = cls(links, rank, rank + 1, list(range(rank + 1)), "0", settings.timeout)
        group.joining = True
        group.elastic = True
        await store.set(f"{prefix}/join/{rank}", b"waiting")
        logger.info("%r joins running elastic job %r as rank %d", group, settings.job, rank)
        return group
